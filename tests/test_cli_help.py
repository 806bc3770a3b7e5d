"""What a user reads in ``--help`` and the listings is plain text: no RST quoting, no docstring line breaks mid-sentence."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from opd_harness.cli import app, plain_text

runner = CliRunner()


def command_paths(typer_app, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every command of ``typer_app`` and its sub-apps, as the words that invoke it."""
    paths = [(*prefix, info.name or info.callback.__name__.rstrip("_").replace("_", "-")) for info in typer_app.registered_commands]
    for group in typer_app.registered_groups:
        paths += command_paths(group.typer_instance, (*prefix, group.name))
    return paths


def test_plain_text_drops_rst_quoting_and_unwraps_paragraphs():
    text = "Stage shards, so ``--resume``\nredoes none (``harness eval``).\n\nSecond paragraph."
    assert plain_text(text) == "Stage shards, so --resume redoes none (harness eval).\n\nSecond paragraph."


@pytest.mark.parametrize("words", [(), *command_paths(app)], ids=lambda words: " ".join(words) or "harness")
def test_help_shows_no_rst_quoting(words):
    result = runner.invoke(app, [*words, "--help"], terminal_width=200)
    assert result.exit_code == 0 and "Usage:" in result.output, result.output
    assert "``" not in result.output, result.output


@pytest.mark.parametrize("words", [(), *command_paths(app)], ids=lambda words: " ".join(words) or "harness")
def test_help_shows_one_example_of_that_command(words):
    text = " ".join(runner.invoke(app, [*words, "--help"], terminal_width=200).output.split()) + " "
    assert f"Example: {' '.join(('harness', *words))} " in text, text


def test_tasks_listing_shows_no_rst_quoting():
    result = runner.invoke(app, ["tasks"])
    assert result.exit_code == 0 and "lm_eval:<name>" in result.output, result.output
    assert "``" not in result.output and "lm_eval:gsm8k" in result.output, result.output


def test_eval_help_shows_its_whole_docstring_unquoted():
    result = runner.invoke(app, ["eval", "--help"], terminal_width=200)
    assert "so --resume redoes none of them" in " ".join(result.output.split()), result.output
