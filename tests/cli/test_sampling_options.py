"""The sampling options, declared once (cli/options.takes_sampling_options) for every command
that samples: each offers all of them, in one order, and receives them gathered."""

from __future__ import annotations

import dataclasses

import pytest
import typer
import typer.main
from typer.testing import CliRunner

from specrun.cli.app import app
from specrun.cli.options import SamplingOptions, TempOpt, takes_sampling_options

FIELDS = [field.name for field in dataclasses.fields(SamplingOptions)]


@pytest.mark.parametrize(("name", "seed"), [("generate", True), ("chat", True), ("bench", True), ("serve", False)])
def test_each_command_that_samples_offers_every_sampling_option_in_one_place(name, seed):
    """Where the command named the bundle, all of its options, in SamplingOptions' order, with its
    defaults (a server's requests bring their own seed)."""
    command = typer.main.get_command(app).commands[name]
    names = [param.name for param in command.params]
    wanted = [field for field in FIELDS if seed or field != "seed"]
    start = names.index(wanted[0])
    assert names[start:start + len(wanted)] == wanted
    defaults = SamplingOptions()
    given = {param.name: param.default for param in command.params if param.name in wanted}
    assert given == {field: getattr(defaults, field) for field in wanted}


def test_a_command_receives_the_options_gathered_and_the_rest_as_they_were():
    received = {}

    @takes_sampling_options()
    def command(prompt: str, sampling_options: SamplingOptions = SamplingOptions(), json: bool = False):
        received.update(prompt=prompt, sampling_options=sampling_options, json=json)

    small = typer.Typer()
    small.command()(command)
    result = CliRunner().invoke(small, ["hello", "--temp", "0.7", "--top-k", "40", "--dry-sequence-breaker", "###",
                                        "--logit-bias", "15+1", "--seed", "3", "--json"])
    assert result.exit_code == 0, result.output
    assert received == {"prompt": "hello", "json": True, "sampling_options": SamplingOptions(
        temp=0.7, top_k=40, dry_sequence_breaker=["###"], logit_bias=["15+1"], seed=3)}


def test_a_command_without_the_bundle_s_parameter_is_refused_when_declared():
    with pytest.raises(TypeError, match="no sampling_options parameter"):
        @takes_sampling_options()
        def command(temp: TempOpt = 0.0):
            pass


def test_without_seed_the_option_is_not_offered():
    @takes_sampling_options(seed=False)
    def command(sampling_options: SamplingOptions = SamplingOptions()):
        pass

    small = typer.Typer()
    small.command()(command)
    result = CliRunner().invoke(small, ["--seed", "3"])
    assert result.exit_code == 2 and "No such option" in result.output
