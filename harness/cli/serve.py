"""``harness serve``: a model behind an OpenAI-compatible API."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer


if TYPE_CHECKING:  # the config models and the task classes are imported by the commands that use them (start-up)
    pass


from opd_harness.cli._common import app, _fail, _quiet_libraries


@app.command("serve", epilog="Example: harness serve --model results/runs/RUN/checkpoints/step-000500 --port 8000")
def serve_(
    model: Annotated[str, typer.Option(help="local model directory (or hub id) to serve")],
    host: Annotated[str, typer.Option(help="interface to bind")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="TCP port")] = 8000,
    max_batch: Annotated[int, typer.Option(help="most sequences (prompt x sample, from any number of requests) decoded together")] = 64,
    max_batch_tokens: Annotated[
        int, typer.Option(help="most padded positions per batch: sequences x (longest prompt + max_tokens)")
    ] = 32768,
    max_logprobs: Annotated[int, typer.Option(help="cap on logprobs / top_logprobs per request (-1: no cap)")] = 20,
    device: Annotated[str | None, typer.Option(help="cpu or cuda (default: cuda when available)")] = None,
    served_model_name: Annotated[str | None, typer.Option(help="model name clients ask for (default: --model as given)")] = None,
    api_key: Annotated[str | None, typer.Option(envvar="HARNESS_SERVE_API_KEY", help="require Authorization: Bearer KEY")] = None,
    max_model_len: Annotated[
        int | None, typer.Option(help="context window: prompt + max_tokens per sequence (default: the model's)")
    ] = None,
    max_request_sequences: Annotated[int, typer.Option(help="most sequences (prompts x n) in one request (more: 400)")] = 1024,
    max_request_tokens: Annotated[
        int, typer.Option(help="most tokens (prompt + max_tokens, over all its sequences) in one request (more: 400)")
    ] = 1 << 20,
    max_queued_sequences: Annotated[int, typer.Option(help="most sequences waiting or decoding, all requests together (more: 503)")] = 4096,
    max_body_bytes: Annotated[int, typer.Option(help="largest request body (more: 413, refused before it is read)")] = 16 << 20,
) -> None:
    """Serve a model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models, /metrics)."""
    from opd_harness.serve import Limits
    from opd_harness.serve import serve as run_server

    _quiet_libraries()
    limits = Limits(max_model_len, max_request_sequences, max_request_tokens, max_queued_sequences, max_body_bytes)
    try:
        run_server(model, host=host, port=port, max_batch=max_batch, max_batch_tokens=max_batch_tokens, max_logprobs=max_logprobs,
                   device=device, model_name=served_model_name, api_key=api_key, limits=limits)  # fmt: skip
    except (OSError, ValueError) as exc:
        raise _fail(str(exc)) from None


