"""``moeguard``: one command for the operator, the worker, the demo, the benchmarks and planning.

    moeguard operator run -A --standalone --prometheus-url http://127.0.0.1:19090
    moeguard worker serve --preset tiny --port 8000
    moeguard demo [--keep]                                            (from a source checkout)
    moeguard bench replay --url http://127.0.0.1:8000 --limit 200     (from a source checkout; any harness.loadgen arguments)
    moeguard plan --preset tiny --memory 8Gi [--skew 4] [--dtype bfloat16]
    moeguard plan --config /models/qwen3-30b-a3b/config.json --memory 80Gi
    moeguard diagnose NAME -n NAMESPACE [--minutes 10] [--plot timeline.png] [--output json]
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from moeguard_cli.plan import DTYPE_BYTES, PlanInput, batching_yaml, estimate
from moeguard_core.family_shape import FamilyShape

ROOT = Path(__file__).resolve().parents[2]
PASS_THROUGH = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}

app = typer.Typer(help="moeguard: memory-safe Mixture-of-Experts inference on Kubernetes.", no_args_is_help=True,
                  add_completion=False)
operator_app = typer.Typer(help="The Kubernetes operator (kopf).", no_args_is_help=True)
worker_app = typer.Typer(help="The torch MoE worker.", no_args_is_help=True)
app.add_typer(operator_app, name="operator")
app.add_typer(worker_app, name="worker")
console = Console()
REPORT_WIDTH = 140
"""Columns of a ``moeguard diagnose`` report written to a file or a pipe."""


@operator_app.command("run", context_settings=PASS_THROUGH)
def operator_run(ctx: typer.Context) -> None:
    """Run the operator; every argument goes to `python -m moeguard_operator` (try `--help`)."""
    from moeguard_operator.__main__ import main

    main(list(ctx.args))


@worker_app.command("serve")
def worker_serve(
    preset: str = typer.Option(None, help="model preset (env MOEGUARD_MODEL_PRESET)"),
    port: int = typer.Option(None, help="HTTP port (env MOEGUARD_PORT)"),
) -> None:
    """Serve the worker (OpenAI /v1/completions, /metrics, /healthz, /readyz); the rest of its
    configuration comes from the environment, as the operator sets it (moeguard_core.contract)."""
    from moeguard_core import contract
    from moeguard_runtime.__main__ import main

    env = dict(os.environ)
    if preset:
        env[contract.ENV_MODEL_PRESET] = preset
    if port:
        env[contract.ENV_PORT] = str(port)
    raise typer.Exit(main(env))


def _from_checkout(what: str, needs: Path, cmd: list[str]) -> None:
    """Run ``cmd`` (a tool that lives in the source checkout, not in the installed package) with
    the checkout on PYTHONPATH; exit with its status, or 2 when ``needs`` is not there."""
    if not needs.exists():
        console.print(f"[red]moeguard {what} needs a source checkout ({needs.relative_to(ROOT)} is not "
                      "installed)[/red]")
        raise typer.Exit(2)
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))
    raise typer.Exit(subprocess.call(cmd, env={**os.environ, "PYTHONPATH": path}))


@app.command("demo", context_settings=PASS_THROUGH)
def demo(ctx: typer.Context) -> None:
    """The end-to-end demo (hack/demo.py, from a source checkout): control plane, operator, workers,
    traffic, the closed loop. Arguments go to hack/demo.py (e.g. --keep)."""
    script = ROOT / "hack" / "demo.py"
    _from_checkout("demo", script, [sys.executable, str(script), *ctx.args])


@app.command("bench", context_settings=PASS_THROUGH)
def bench(ctx: typer.Context) -> None:
    """The load generator, from a source checkout: `moeguard bench replay|burst --url URL ...` runs
    `python -m harness.loadgen` (shows a progress bar unless --no-progress)."""
    _from_checkout("bench", ROOT / "harness" / "loadgen", [sys.executable, "-m", "harness.loadgen", *ctx.args])


def parse_memory(text: str) -> int:
    """A Kubernetes memory quantity (``8Gi``, ``512Mi``, ``1G``) in bytes."""
    from kubernetes.utils.quantity import parse_quantity

    try:
        value = int(parse_quantity(text))
    except (ValueError, ArithmeticError) as exc:
        raise typer.BadParameter(f"not a memory quantity: {text!r}") from exc
    if not 0 < value < 2**60:
        raise typer.BadParameter(f"memory must be above 0 and below 1Ei, given {text!r}")
    return value


def parse_shape(text: str) -> dict[str, int]:
    """``n_layer=32,dim=4096,...`` → a dict of ModelArgs fields."""
    out = {}
    for part in filter(None, text.split(",")):
        key, _, value = part.partition("=")
        if not value:
            raise typer.BadParameter(f"expected key=value, got {part!r}")
        out[key.strip()] = int(value)
    return out


def read_config(path: Path) -> FamilyShape:
    """The shape of an HF ``config.json`` (a file, or a folder holding one); a usage error
    names the file and the key when it cannot be read."""
    import json

    from moeguard_core.family_shape import ConfigError, from_hf_config

    file = path / "config.json" if path.is_dir() else path
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise typer.BadParameter(f"{file}: cannot read ({exc})", param_hint="--config") from None
    if not isinstance(data, dict):
        raise typer.BadParameter(f"{file}: not a JSON object", param_hint="--config")
    try:
        return from_hf_config(data)
    except ConfigError as exc:
        raise typer.BadParameter(f"{file}: {exc}", param_hint="--config") from None


@app.command("plan")
def plan(
    memory: str = typer.Option(..., "--memory", "-m", help="memory limit (Kubernetes quantity): the container's "
                               "hardLimit on CPU, the GPU's memory on a GPU"),
    preset: str = typer.Option("tiny", help="model preset (moeguard_core.presets)"),
    config: str = typer.Option(None, "--config", help="an HF config.json (or its folder) of a served family "
                                "(mixtral, qwen2_moe, qwen3_moe, deepseek_v3, olmoe), instead of --preset"),
    shape: str = typer.Option("", help="shape overrides, e.g. n_layer=32,dim=4096,num_experts=8,top_k=2"),
    dtype: str = typer.Option("bfloat16", help="weight and activation dtype: " + ", ".join(DTYPE_BYTES)),
    skew: float = typer.Option(4.0, min=1.0, max=1e6, help="expert skew ratio to plan for (top / median expert tokens), >= 1"),
    headroom: float = typer.Option(0.10, min=0.0, max=0.9, help="fraction of the limit kept free"),
    overhead: str = typer.Option("512Mi", help="CUDA context, allocator and process overhead"),
    concurrent_batches: int = typer.Option(2, min=1, max=64, help="maxConcurrentBatches"),
    context_tokens: int = typer.Option(None, "--context-tokens", min=1,
                                       help="expected prompt + max_tokens per running sequence, to size the "
                                       "KV share (default: the model's max_seq_len, the worst case); the "
                                       "worst prefill step is still sized at max_seq_len"),
) -> None:
    """Print starting budgets for a model and a memory limit, with the arithmetic: the memory model
    (core/moeguard_core/memory_model.py, validated in bench/results/memory_model.md) inverted."""
    import dataclasses

    from moeguard_core.family_shape import FamilyShape
    from moeguard_core.presets import ModelArgs, get_preset, shape_problems

    if dtype not in DTYPE_BYTES:
        raise typer.BadParameter(f"dtype must be one of {', '.join(DTYPE_BYTES)}", param_hint="--dtype")
    args: ModelArgs | FamilyShape
    if config is not None:
        args = read_config(Path(config))
        name = f"{args.model_type} ({config})"
    else:
        try:
            args = get_preset(preset)
        except KeyError as exc:
            raise typer.BadParameter(str(exc.args[0]), param_hint="--preset") from None
        name = preset
    try:
        args = dataclasses.replace(args, **parse_shape(shape))  # type: ignore[arg-type]
    except TypeError as exc:
        raise typer.BadParameter(str(exc), param_hint="--shape") from None
    problems = (shape_problems(args) if isinstance(args, ModelArgs) else []) + [
        f"{k} ({v}) must be positive" for k, v in dataclasses.asdict(args).items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v <= 0
        and k in ("n_layer", "dim", "n_head", "n_kv_head", "head_dim", "intermediate_size", "num_experts",
                  "top_k", "max_seq_len", "vocab_size")]
    if isinstance(args, FamilyShape) and args.top_k > args.num_experts:
        problems.append(f"top_k ({args.top_k}) must be at most num_experts ({args.num_experts})")
    if problems:
        raise typer.BadParameter("; ".join(problems), param_hint="--config" if config else "--shape")
    if skew != skew:  # NaN passes min/max checks
        raise typer.BadParameter("must be a number", param_hint="--skew")
    result = estimate(PlanInput(args=args, memory_bytes=parse_memory(memory), dtype=dtype, skew=skew,
                                headroom=headroom, overhead_bytes=parse_memory(overhead),
                                concurrent_batches=concurrent_batches, context_tokens=context_tokens))
    table = Table(title=f"plan: {name} in {memory} ({dtype}, skew {skew})")
    for col in ("term", "value", "arithmetic"):
        table.add_column(col)
    for row in result.lines:
        table.add_row(*row)
    console.print(table)
    if not result.fits:
        console.print("[red]does not fit: the weights and overhead leave no room for a 16-token prefill[/red]")
        raise typer.Exit(1)
    console.print(batching_yaml(result), markup=False)


@app.command("diagnose")
def diagnose(
    name: str = typer.Argument(..., help="the MoEInferenceService"),
    namespace: str = typer.Option(None, "--namespace", "-n", help="its namespace (default: the context's, else "
                                  "default)"),
    prometheus_url: str = typer.Option(None, "--prometheus-url", help="Prometheus base URL (default: the service's "
                                       "spec.control.prometheusUrl, else env MOEGUARD_PROMETHEUS_URL, else "
                                       "http://127.0.0.1:9090)"),
    minutes: int = typer.Option(10, min=1, max=1440, help="length of the timeline, minutes (one row per 30 s)"),
    plot_file: str = typer.Option(None, "--plot", help="also draw the timeline into this PNG file"),
    output: str = typer.Option("text", "--output", "-o", help="text (for people) or json (the whole report)"),
    kubeconfig: str = typer.Option(None, "--kubeconfig", help="kubeconfig file (default: KUBECONFIG, "
                                   "~/.kube/config, or in-cluster)"),
    context: str = typer.Option(None, "--context", help="kubeconfig context (default: the current one)"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress on stderr"),
) -> None:
    """Why is this service in trouble? Its findings (status.diagnosis) with evidence, remedy and the kubectl
    patch, the signals missing, a timeline of the last minutes from Prometheus, and its Events. Exit code 1
    when the API server cannot be reached or the service is absent; Prometheus missing only leaves gaps."""
    from contextlib import nullcontext

    from moeguard_cli import diagnose_fetch
    from moeguard_cli.diagnose_report import build_report, render

    if output not in ("text", "json"):
        raise typer.BadParameter("must be text or json", param_hint="--output")
    err = Console(stderr=True)
    show = not quiet and err.is_terminal
    status = err.status("moeguard diagnose") if show else nullcontext()
    try:
        with status as spinner:
            def progress(what: str) -> None:
                if spinner is not None:
                    spinner.update(what)

            got = diagnose_fetch.fetch(name, namespace, prometheus_url=prometheus_url, minutes=minutes,
                                       kubeconfig=kubeconfig, context=context, progress=progress)
    except diagnose_fetch.DiagnoseError as exc:  # printed once the progress line is gone
        err.print(f"error: {exc}", markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None
    report = build_report(got.service, got.events, got.answers, now=got.now, minutes=minutes,
                          prometheus_url=got.prometheus_url, events_problem=got.events_problem)
    if output == "json":
        print(report.model_dump_json(indent=2))
    else:
        # Piped or redirected, rich would wrap at 80 columns and cut the timeline's times: a report in a file or
        # a ticket reads better wide (COLUMNS still wins).
        wide = console if console.is_terminal or os.environ.get("COLUMNS") else Console(width=REPORT_WIDTH)
        render(report, wide)
    if plot_file is not None:
        from moeguard_cli.diagnose_plot import plot

        try:
            import matplotlib  # noqa: F401 - an optional dependency (moeguard[plot])
        except ImportError:
            err.print("error: --plot needs matplotlib (pip install 'moeguard[plot]')", markup=False, highlight=False)
            raise typer.Exit(1) from None
        try:
            plot(report, Path(plot_file))
        except OSError as exc:
            err.print(f"error: cannot write {plot_file}: {exc.strerror or exc}", markup=False, highlight=False)
            raise typer.Exit(1) from None
        if output != "json":
            console.print(f"timeline drawn into {plot_file}", markup=False, soft_wrap=True)  # a path is never wrapped


def main() -> None:
    app()


if __name__ == "__main__":
    main()
