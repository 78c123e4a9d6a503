"""One error family: every user-facing failure is a SpecrunError with a fix.

The CLI maps these to a one-line message and an exit code; tracebacks are shown
only with SPECRUN_DEBUG=1.
"""

from __future__ import annotations


class SpecrunError(Exception):
    """A failure the user can act on. ``fix`` says how."""

    exit_code = 1

    def __init__(self, problem: str, fix: str = "") -> None:
        super().__init__(problem)
        self.problem = problem
        self.fix = fix

    def one_line(self) -> str:
        return f"{self.problem}; {self.fix}" if self.fix else self.problem


class UsageError(SpecrunError):
    """Bad command-line usage (exit 2)."""

    exit_code = 2


class ModelFileError(SpecrunError):
    """A model file that is missing, unreadable or not a model."""


class IncompatibleModelsError(SpecrunError):
    """A drafter whose vocabulary differs from the target's."""


class ContextFullError(SpecrunError):
    """The prompt (or conversation) does not fit the model's context."""


class ChatTemplateError(SpecrunError):
    """A model's chat template that is unsafe, invalid, or refuses the conversation."""


class ConversationRefusedError(ChatTemplateError):
    """The template raised on this conversation (roles out of order, a system message it takes
    only first): the conversation is to change, not the model. ``problem`` says the template's words."""


class BackendUnavailableError(SpecrunError):
    """The requested backend is not installed or cannot run here."""


class RemoteServerError(SpecrunError):
    """An RPC server (``--rpc``) that cannot be reached or does not speak llama.cpp's protocol."""


class RegistryError(SpecrunError):
    """An unknown alias or a malformed models.toml."""


class AnswerKeptError(SpecrunError):
    """The answer is complete, but something after it failed (the n-gram cache could not be
    saved): front ends print ``result`` as usual, then this error."""

    def __init__(self, result: object, error: SpecrunError) -> None:
        super().__init__(error.problem, error.fix)
        self.result = result


class FileAccessError(SpecrunError):
    """A file specrun cannot read or write (full disk, no permission, not a regular file, too big)."""


def cannot_listen(host: str, port: int, exc: OSError, busy: type[SpecrunError] = SpecrunError) -> SpecrunError:
    """One line for a socket that cannot listen on ``host:port``, named by its cause: a port in use
    or below 1024 is the machine's state (``busy``, exit 1), a host that is no address of this
    machine (or one it cannot listen on) a usage error."""
    import errno

    where = f"cannot listen on {host}:{port}"
    if exc.errno == errno.EADDRINUSE:
        return busy(f"{where}: something else listens on port {port}", "pass another --port, or stop what uses it")
    if exc.errno == errno.EACCES and port < 1024:
        return busy(f"{where}: ports below 1024 need administrator rights", "pass a --port of 1024 or more")
    if exc.errno == errno.EACCES:  # a security policy (SELinux, a raised unprivileged port start)
        return busy(f"{where}: permission denied", "pass another --port, or ask the machine's administrator")
    if exc.errno == errno.EADDRNOTAVAIL:
        return UsageError(f"{where}: {host} is not an address of this machine",
                          "pass 127.0.0.1 (this machine only), 0.0.0.0 (every network) or one of its addresses")
    return UsageError(f"{where}: {exc.strerror or exc}", "pass another --host or --port")
