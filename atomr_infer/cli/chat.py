"""``atomr chat NAME [PROMPT]``: stream an answer to stdout, or hold a conversation.

With a prompt (or text piped on stdin) it answers once. Without one, in a terminal, it keeps
the conversation: each answer is added to the history that the next question is sent with.
``/clear`` forgets it, ``/bye`` or Ctrl-D leaves.

Ctrl-C while an answer streams stops it: the stream's task is cancelled, the router cancels the
replica's Ray generator, and the replica aborts the request in the engine. A one-shot chat
then exits 130; an interactive one keeps the partial answer and asks for the next question.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from typing import Any

import typer

from atomr_infer.cli import common
from atomr_infer.cli.app import EXIT_INTERRUPTED, EXIT_OK, app, err, fail, usage_error
from atomr_infer.errors import (
    AtomrError,
    DeploymentNotFound,
    EngineStartFailed,
    InvalidRequest,
    NoReadyReplica,
    one_line,
)

HELP = "/clear forgets the conversation, /bye or Ctrl-D leaves; Ctrl-C stops an answer."


def _check_target(control: Any, name: str) -> None:
    """``DeploymentNotFound`` unless ``name`` names what the HTTP API would route (a deployment,
    one of its ``served_model_name`` aliases, ``<deployment>:<adapter>`` or an adapter's bare
    name); ``EngineStartFailed`` saying why when its deployment gave up starting replicas."""
    table = control.routing_table()  # None while a restarted manager recovers
    deployment = table.resolve(name)[0] if table is not None and table.knows(name) else None
    status = control.status(deployment.name if deployment is not None else name)
    if status is None:
        raise DeploymentNotFound(name, [s.name for s in control.list()])
    if status.failed:
        raise EngineStartFailed(f"deployment {status.name!r} failed and starts no replica: {status.last_failure}")
    routes = next((r.routes for r in status.replicas if r.routes), ())  # as its replicas' vLLM serves them
    if routes and "POST /v1/chat/completions" not in routes:
        served = sorted({route.split(" ", 1)[1] for route in routes if route.startswith("POST /v1/")})
        raise InvalidRequest("model", f"deployment {status.name!r} does not chat (its model serves "
                             f"{', '.join(served) or 'no /v1 route'}, e.g. as an embedding model)")


@app.command("chat")
def chat_command(
    name: str = typer.Argument(..., help="Deployment name.", show_default=False),
    prompt: str | None = typer.Argument(None, help="Ask once and exit (default: a conversation).", show_default=False),
    max_tokens: int | None = typer.Option(None, "--max-tokens", min=1, help="Most tokens per answer."),
    temperature: float = typer.Option(
        0.0, "--temperature", min=0.0, help="Sampling temperature; 0 (greedy) gives the same answer each time."
    ),
    system: str | None = typer.Option(None, "--system", help="A system prompt."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Keep generating until --max-tokens (load tests)."),
    address: str | None = common.address_option(),
) -> None:
    """Chat with a deployment; the answer streams to stdout as it is generated."""
    from atomr_infer.client import Client

    if ignore_eos and max_tokens is None:  # no end of sequence: it would run to the end of the context
        usage_error("--ignore-eos needs --max-tokens (without it the answer runs to the end of the context)")
    if prompt is not None and not prompt.strip():
        usage_error("the prompt is empty: give a question, or none to converse")
    if prompt is None and (sys.stdin is None or not sys.stdin.isatty()):
        prompt = sys.stdin.read().strip() if sys.stdin is not None else ""
        if not prompt:
            usage_error("no prompt: give one as an argument, on stdin, or run in a terminal to converse")
    try:
        control = common.control_plane(address, start=False)
        _check_target(control, name)  # say so before asking anything
        client = Client(manager=control.handle)
    except AtomrError as exc:
        fail(exc)
    sampling: dict[str, Any] = {"temperature": temperature}
    if max_tokens is not None:
        sampling["max_tokens"] = max_tokens
    if ignore_eos:
        sampling["ignore_eos"] = True
    history = [{"role": "system", "content": system}] if system else []
    loop = asyncio.new_event_loop()
    try:
        if prompt is not None:
            messages = [*history, {"role": "user", "content": prompt}]
            try:
                _, interrupted = _answer(loop, client, name, messages, sampling)
            except AtomrError as exc:
                fail(exc)
            code = EXIT_INTERRUPTED if interrupted else EXIT_OK
        else:
            code = _converse(loop, client, name, history, sampling)
    finally:
        loop.run_until_complete(client.aclose())
        loop.close()
    raise typer.Exit(code)


def _converse(loop: asyncio.AbstractEventLoop, client: Any, name: str, system: list[dict[str, str]],
              sampling: dict[str, Any]) -> int:
    err.print(f"chatting with {name}. {HELP}", style="dim", markup=False)
    history = list(system)
    while True:
        try:
            question = input(">>> ")
        except EOFError:
            sys.stdout.write("\n")
            return EXIT_OK
        except KeyboardInterrupt:
            sys.stdout.write("\n")
            return EXIT_INTERRUPTED
        command = question.strip()
        if not command:
            continue
        if command in ("/bye", "/exit", "/quit"):
            return EXIT_OK
        if command == "/clear":
            history = list(system)
            err.print("conversation cleared", style="dim", markup=False)
            continue
        if command in ("/?", "/help"):
            err.print(HELP, style="dim", markup=False)
            continue
        history.append({"role": "user", "content": question})
        try:
            text, _ = _answer(loop, client, name, history, sampling)
        except AtomrError as exc:  # say so and ask again: the conversation goes on
            err.print(f"error: {exc}", markup=False)
            text = ""
        if text:
            history.append({"role": "assistant", "content": text})
        else:
            history.pop()  # nothing came back: ask again without a dangling question
        sys.stdout.write("\n")


def _answer(loop: asyncio.AbstractEventLoop, client: Any, name: str, messages: list[dict[str, str]],
            sampling: dict[str, Any]) -> tuple[str, bool]:
    """Stream one answer to stdout; returns (text, interrupted). Raises ``AtomrError``."""
    parts: list[str] = []
    finish: list[str | None] = [None]
    try:
        interrupted = loop.run_until_complete(_stream(client, name, messages, sampling, parts, finish))
    except NoReadyReplica as exc:
        raise AtomrError(f"{exc} (hint: `atomr status {name}` shows why)") from None
    except AtomrError:
        raise
    except Exception as exc:  # noqa: BLE001 - Ray errors: one line
        raise AtomrError(one_line(exc)) from None
    finally:
        if parts and not parts[-1].endswith("\n"):
            sys.stdout.write("\n")
        sys.stdout.flush()
    if interrupted:
        err.print("interrupted: the request was aborted", style="dim", markup=False)
    elif finish[0] == "length":
        err.print("(stopped at the token limit: --max-tokens, or what is left of max_model_len)", style="dim",
                  markup=False)
    return "".join(parts), interrupted


async def _stream(client: Any, name: str, messages: list[dict[str, str]], sampling: dict[str, Any],
                  parts: list[str], finish: list[str | None]) -> bool:
    """Run the stream as a task that Ctrl-C cancels; True if it was interrupted."""

    async def consume() -> None:
        async for chunk in client.astream_chat_events(name, messages, **sampling):
            if not chunk.get("choices"):
                continue
            choice = chunk["choices"][0]
            text = (choice.get("delta") or {}).get("content")
            if text:
                sys.stdout.write(text)
                sys.stdout.flush()
                parts.append(text)
            finish[0] = choice.get("finish_reason") or finish[0]

    loop = asyncio.get_running_loop()
    task = loop.create_task(consume())
    loop.add_signal_handler(signal.SIGINT, task.cancel)
    try:
        await task
        return False
    except asyncio.CancelledError:
        if not task.cancelled():
            raise
        await asyncio.sleep(0.2)  # let Ray send the cancellation before anything exits
        return True
    finally:
        loop.remove_signal_handler(signal.SIGINT)
