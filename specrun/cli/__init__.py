"""Front ends: one module per command; each parses, validates, calls one library function and renders."""
