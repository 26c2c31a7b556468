"""The transformers zoo: which families does dynaprobe fully check? (docs/real-models.md).

Enumerates the installed transformers' causal-LM classes, and its masked-LM (encoder), seq2seq
and image-classification classes, builds each from its own config class at generic tiny sizes
(hidden 64, 2 layers, 4 heads, vocabulary 128, dropout 0) and, with its repeated layers wrapped:

- trains one step eagerly, then compiled (aot_eager) without the checker: a family that fails
  either is *not checkable* here (it does not build or train at tiny sizes, or torch cannot
  compile it without the checker);
- trains the same step single-pass with the checker, per dtype (float32, bfloat16 with the
  default reference): *checked* when every row passes, every layer has forward and backward rows,
  and loss and gradients are bit-identical to the unchecked compiled step; else *short*, and why;
  --backends aot_eager,inductor adds a column per dtype compiled under inductor (a family torch
  cannot compile there without the checker reads *not checkable* in that column only);
- runs one two-pass inference and expects every row to pass.

Each family runs in a process of its own, under a memory limit and a time limit. Prints a
markdown table and the totals; --json keeps one line per family.

    .venv/bin/python bench/zoo_sweep.py [--kinds causal-lm,masked-lm,seq2seq,vision]
        [--only llama,dory] [--dtypes float32,bfloat16] [--backends aot_eager,inductor]
        [--jobs 2] [--timeout 600] [--memory-gb 16] [--json results.jsonl]
    .venv/bin/python bench/zoo_sweep.py --coverage results.jsonl   (the docs' coverage section;
        the latest line of a family wins, so rerunning some families appends to the file)
"""

from __future__ import annotations

import argparse
import concurrent.futures
import copy
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

KINDS = {  # kind -> (transformers mapping of model type to class name, auto class)
    "causal-lm": ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "AutoModelForCausalLM"),
    "masked-lm": ("MODEL_FOR_MASKED_LM_MAPPING_NAMES", "AutoModelForMaskedLM"),
    "seq2seq": ("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "AutoModelForSeq2SeqLM"),
    "vision": ("MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", "AutoModelForImageClassification"),
}
# Generic tiny sizes, under every name configs give them; only names a config has are set.
SIZES = {
    "vocab_size": 128, "hidden_size": 64, "d_model": 64, "n_embd": 64, "dim": 64, "emb_dim": 64,
    "intermediate_size": 128, "ffn_dim": 128, "encoder_ffn_dim": 128, "decoder_ffn_dim": 128,
    "n_inner": 128, "num_hidden_layers": 2, "num_layers": 2, "n_layer": 2, "n_layers": 2,
    "encoder_layers": 2, "decoder_layers": 2, "num_decoder_layers": 2,
    "num_attention_heads": 4, "num_heads": 4, "n_head": 4, "n_heads": 4,
    "encoder_attention_heads": 4, "decoder_attention_heads": 4, "num_key_value_heads": 4,
    "image_size": 32, "patch_size": 4,
}
BATCH, SEQ = 2, 8
CHECKED, SHORT, NOT_CHECKABLE = "checked", "short", "not checkable"


# ---------------------------------------------------------------------------- one family
def tiny_config(config_class):
    defaults = config_class().to_dict()
    values = {k: v for k, v in SIZES.items() if k in defaults}
    for key, value in defaults.items():
        if isinstance(value, float) and ("dropout" in key or "pdrop" in key):
            values[key] = 0.0
    return config_class(**values)


def layer_classes(model) -> tuple:
    """The classes of the repeated layers a user wraps: the members of the outermost
    ModuleLists holding two or more modules with parameters (containers are looked into)."""
    import torch.nn as nn

    containers = (nn.ModuleList, nn.ModuleDict, nn.Sequential)
    found, inside = [], []
    for name, module in model.named_modules():
        if any(name.startswith(prefix) for prefix in inside):
            continue
        if isinstance(module, nn.ModuleList) and len(module) >= 2 and all(
                any(True for _ in m.parameters()) and not isinstance(m, containers)
                for m in module):
            inside.append(name + ".")
            found.extend(type(m) for m in module if type(m) not in found)
    return tuple(found)


def layers_run(model, classes: tuple, step) -> set:
    """The names of the layers of ``classes`` that ``step(model)`` runs: those a user wraps (a
    text batch leaves a multimodal model's vision layers out)."""
    ran, handles = set(), []
    for name, module in model.named_modules():
        if isinstance(module, classes):
            handles.append(module.register_forward_pre_hook(
                lambda *_, name=name: ran.add(name)))
    try:
        step(model)
    finally:
        for handle in handles:
            handle.remove()
    return ran


def batch_for(kind: str, model, train: bool) -> dict:
    import torch

    config = model.config
    if kind == "vision":
        size = getattr(config, "image_size", 32)
        size = size[0] if isinstance(size, (list, tuple)) else size
        channels = getattr(config, "num_channels", 3)
        batch = {"pixel_values": torch.randn(BATCH, channels, size, size)}
        if train:
            batch["labels"] = torch.arange(BATCH) % max(getattr(config, "num_labels", 2), 1)
        return batch
    vocab = min(getattr(config, "vocab_size", 128) or 128, 128)
    ids = torch.randint(3, vocab, (BATCH, SEQ))
    batch = {"input_ids": ids}
    if kind == "seq2seq":
        target = torch.randint(3, vocab, (BATCH, SEQ - 2))
        batch["labels" if train else "decoder_input_ids"] = target
    elif train:
        batch["labels"] = ids
    return batch


def train_step(model, batch):
    import torch

    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    loss = model(**batch).loss
    if loss is None:
        raise RuntimeError("the model returns no loss for labels")
    loss.backward()
    return loss.detach(), {n: None if p.grad is None else p.grad.clone()
                           for n, p in model.named_parameters()}


def same_training(a, b) -> str:
    """'' when two steps' loss and gradients (and buffers, when the steps give a third dict) are
    bit-identical, else what differs."""
    import torch

    if not torch.equal(a[0], b[0]):
        return f"loss {a[0].item()!r} != {b[0].item()!r}"
    for what, mine, theirs in zip(("gradient", "buffer"), a[1:], b[1:]):
        for name, value in mine.items():
            other = theirs[name]
            if (value is None) != (other is None) or (
                    value is not None and not torch.equal(value, other)):
                return f"{what} of {name}"
    return ""


def short_reason(result, layer_names) -> str:
    """Why a checked step is short of fully checked: rows not passing, layers without rows."""
    bad = [f"{r.module} {r.check_type} {r.status} {r.note or r.reason}".strip()
           for r in result.rows if r.status not in ("PASS", "SKIP")]
    if bad:
        return f"{len(bad)} row(s) not passing, e.g. {bad[0][:160]}"
    kinds = {}
    for row in result.rows:
        kinds.setdefault(row.module, set()).add(row.check_type)
    for name in layer_names:  # a first layer given pixels or ids has no grad_input: its
        # parameters' gradients are its backward then
        have = kinds.get(name, set())
        if "fwd_output" not in have or not have & {"grad_input", "param_grad"}:
            return f"{name}: no forward or no backward rows ({', '.join(sorted(have))})"
    return ""


def column(backend: str, dtype_name: str) -> str:
    """A table column: the dtype's name under aot_eager (the default), else backend and dtype."""
    return dtype_name if backend == "aot_eager" else f"{backend} {dtype_name}"


def check_family(kind: str, model_type: str, dtypes: list, backends=("aot_eager",)) -> dict:
    import torch
    import torch._inductor.config
    import transformers
    from transformers.models.auto import modeling_auto

    torch.set_num_threads(1)
    # The unchecked baseline compiles each layer's forward, all instances sharing one code object:
    # past Dynamo's recompile limit (8) later layers would run eagerly, unlike under the checker,
    # which compiles each layer through its own. A higher limit compiles them all.
    torch._dynamo.config.recompile_limit = 1024
    torch._dynamo.config.accumulated_recompile_limit = 4096
    torch._inductor.config.compile_threads = 1  # inductor's compile workers: one core
    mapping = getattr(modeling_auto, KINDS[kind][0])
    entry = {"kind": kind, "family": model_type, "class": mapping[model_type]}

    def outcome(status: str, why: str = "", **more) -> dict:
        entry.update(status=status, why=why[:300], **more)
        return entry

    try:
        config = tiny_config(transformers.AutoConfig.for_model(model_type).__class__)
        torch.manual_seed(0)
        model = getattr(transformers, KINDS[kind][1]).from_config(config)
    except Exception as error:
        return outcome(NOT_CHECKABLE, f"does not build at tiny sizes: {type(error).__name__}: "
                       f"{error}")
    classes = layer_classes(model)
    if not classes:
        return outcome(NOT_CHECKABLE, "no repeated layers to wrap")
    entry["layers"] = [c.__name__ for c in classes]
    results = {}
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        base = copy.deepcopy(model).to(dtype).train()
        batch = batch_for(kind, base, train=True)
        if kind == "vision":
            batch["pixel_values"] = batch["pixel_values"].to(dtype)
        try:
            ran = layers_run(copy.deepcopy(base), classes, lambda m: train_step(m, batch))
            if not ran:
                return outcome(NOT_CHECKABLE, "its training step runs none of its repeated layers")
        except Exception as error:
            return outcome(NOT_CHECKABLE, f"{dtype_name} eager training fails at tiny sizes: "
                           f"{type(error).__name__}: {error}", **results)
        for backend in backends:
            key = column(backend, dtype_name)
            compiled = compiled_layers(base, ran, backend)
            torch._dynamo.reset()
            try:
                expected = train_step(compiled, batch)
            except Exception as error:
                why = f"torch cannot compile its layers without the checker: " \
                      f"{type(error).__name__}: {error}"
                if backend == "aot_eager":
                    return outcome(NOT_CHECKABLE, f"{dtype_name}: {why}", **results)
                results[key] = f"{NOT_CHECKABLE}: {why}"
                continue
            results[key] = single_pass_checked(copy.deepcopy(base), ran, backend,
                                               lambda m: train_step(m, batch), expected)
    results["inference"] = two_pass_inference(kind, model, ran)
    shorts = [f"{k}: {v.split(': ', 1)[1]}" for k, v in results.items() if v != CHECKED]
    return outcome(SHORT if shorts else CHECKED, "; ".join(shorts), **results)


def compiled_layers(model, ran: set, backend: str):
    """The user's own compiled setup, without the checker: a deep copy of ``model`` with the
    forward of each layer named in ``ran`` compiled in place, as install() compiles them."""
    import torch

    model = copy.deepcopy(model)
    for name, module in model.named_modules():
        if name in ran:
            module.forward = torch.compile(module.forward, backend=backend)
    return model


def single_pass_checked(model, ran: set, backend: str, step, expected) -> str:
    """One single-pass checked ``step`` of ``model`` (it returns the loss and the gradients, and
    may return the buffers) with the layers named in ``ran`` wrapped: checked when every row
    passes, every layer has forward and backward rows and the step is ``expected`` (the
    unchecked compiled step) bit for bit; else short, and why."""
    import torch

    from dynaprobe import PrecisionChecker

    torch._dynamo.reset()
    with tempfile.TemporaryDirectory() as dump:
        checker = PrecisionChecker(backend=backend, dump_dir=dump)
        for name, module in model.named_modules():
            if name in ran:
                checker.wrap(module)
        checker.install(model)
        try:
            got = step(model)
            result = checker.collect(got[0])
        except Exception as error:
            return f"{SHORT}: the checked step raised {type(error).__name__}: {error}"
        finally:
            checker.uninstall()
    why = short_reason(result, sorted(ran)) or (
        "" if not (d := same_training(got, expected)) else f"training changed: {d}")
    return CHECKED if not why else f"{SHORT}: {why}"


def two_pass_inference(kind: str, model, ran: set) -> str:
    import torch

    model = copy.deepcopy(model).eval()
    batch = batch_for(kind, model, train=False)

    def step(m):
        with torch.no_grad():
            out = m(**batch)
        logits = out.logits if getattr(out, "logits", None) is not None else out[0]
        return logits.float().mean()

    return two_pass_checked(model, ran, step)


def two_pass_checked(model, ran: set, step) -> str:
    """One two-pass ``step`` of ``model`` with the layers named in ``ran`` wrapped: checked
    when every row passes, else short, and why."""
    import torch

    from dynaprobe import PrecisionChecker

    torch._dynamo.reset()
    with tempfile.TemporaryDirectory() as dump:
        checker = PrecisionChecker(single_pass=False, dump_dir=dump)
        for name, module in model.named_modules():
            if name in ran:
                checker.wrap(module)
        try:
            result = checker.compare(step, model)
        except Exception as error:
            return f"{SHORT}: two-pass raised {type(error).__name__}: {error}"
    why = short_reason(result, [])
    return CHECKED if not why else f"{SHORT}: {why}"


# ---------------------------------------------------------------------------- the sweep
def families(kinds: list, only: set) -> list:
    from transformers.models.auto import modeling_auto

    found = []
    for kind in kinds:
        for model_type in getattr(modeling_auto, KINDS[kind][0]):
            if not only or model_type in only:
                found.append((kind, model_type))
    return found


def run_isolated(kind: str, model_type: str, args) -> dict:
    command = [sys.executable, os.path.abspath(__file__), "--worker", kind, model_type,
               "--dtypes", args.dtypes, "--backends", args.backends]
    return run_worker(command, {"kind": kind, "family": model_type}, args.timeout,
                      args.memory_gb)


def run_worker(command: list, names: dict, timeout: int, memory_gb: int) -> dict:
    """Runs ``command`` (a --worker process printing one JSON line) under a memory limit and a
    time limit; its entry, or ``names`` with why it gave none."""
    limit = memory_gb << 30

    def limit_memory():
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    started = time.monotonic()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                              preexec_fn=limit_memory)
    except subprocess.TimeoutExpired:
        entry = {**names, "status": NOT_CHECKABLE, "why": f"timed out after {timeout} s"}
    else:
        lines = [l for l in done.stdout.splitlines() if l.startswith("{")]
        if lines:
            entry = json.loads(lines[-1])
        else:
            tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
            memory = any(s in done.stderr for s in ("MemoryError", "allocate memory")) \
                or done.returncode in (-9, 137)
            entry = {**names, "status": NOT_CHECKABLE,
                     "why": ("over the memory limit: " if memory else "the process died: ")
                     + tail[:200]}
    entry["seconds"] = round(time.monotonic() - started, 1)
    return entry


def table(entries: list, columns: list, noun: str = "families") -> str:
    lines = ["| kind | family | status | " + " | ".join(columns) + " | why |",
             "|---" * (4 + len(columns)) + "|"]
    for e in entries:
        cells = [e.get(c, "").split(":")[0] for c in columns]
        lines.append(f"| {e['kind']} | {e['family']} | {e['status']} | " + " | ".join(cells)
                     + f" | {e.get('why', '').replace('|', '/')} |")
    counts = {}
    for e in entries:
        counts[e["status"]] = counts.get(e["status"], 0) + 1
    lines.append("")
    lines.append(f"{len(entries)} {noun}: " + ", ".join(f"{counts.get(s, 0)} {s}" for s in
                                                         (CHECKED, SHORT, NOT_CHECKABLE)))
    return "\n".join(lines)


def coverage(entries: list, library: str = "transformers", noun: str = "families") -> str:
    """docs/real-models.md's coverage section: totals per kind for the installed ``library``,
    then every family short of fully checked, with why."""
    version = __import__(library).__version__
    kinds = sorted({e["kind"] for e in entries})
    lines = [f"{library} {version}, torch {__import__('torch').__version__}:", "",
             f"| kind | {noun} | fully checked | short | not checkable |", "|---|---|---|---|---|"]
    for kind in kinds + ["all"]:
        mine = [e for e in entries if kind in ("all", e["kind"])]
        count = {s: sum(e["status"] == s for e in mine) for s in (CHECKED, SHORT, NOT_CHECKABLE)}
        lines.append(f"| {kind} | {len(mine)} | {count[CHECKED]} | {count[SHORT]} | "
                     f"{count[NOT_CHECKABLE]} |")
    lines += ["", f"| kind | {noun[:-3] + 'y' if noun.endswith('ies') else noun[:-1]} "
              "| status | why |", "|---|---|---|---|"]
    for e in sorted(entries, key=lambda e: (e["status"], e["kind"], e["family"])):
        if e["status"] != CHECKED:
            why = " ".join(e.get("why", "").split()).replace("|", "/")[:160]
            lines.append(f"| {e['kind']} | {e['family']} | {e['status']} | {why} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--only", default="", help="model types, comma-separated (e.g. llama)")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--backends", default="aot_eager",
                        help="comma-separated, e.g. aot_eager,inductor: a column per dtype each")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--timeout", type=int, default=600, help="seconds per family")
    parser.add_argument("--memory-gb", type=int, default=16, help="address space per family")
    parser.add_argument("--json", help="also write one JSON line per family here")
    parser.add_argument("--coverage", metavar="JSONL",
                        help="print docs/real-models.md's coverage section from a --json file")
    parser.add_argument("--worker", nargs=2, metavar=("KIND", "MODEL_TYPE"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    dtypes = [d for d in args.dtypes.split(",") if d]
    backends = [b for b in args.backends.split(",") if b]
    if args.worker:
        print(json.dumps(check_family(*args.worker, dtypes, backends)), flush=True)
        return
    if args.coverage:
        with open(args.coverage) as f:
            latest = {(e["kind"], e["family"]): e for e in map(json.loads, f)}
        print(coverage(list(latest.values())))
        return
    todo = families([k for k in args.kinds.split(",") if k],
                    {o for o in args.only.split(",") if o})
    entries = []
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        futures = [pool.submit(run_isolated, kind, name, args) for kind, name in todo]
        for future in concurrent.futures.as_completed(futures):
            entry = future.result()
            entries.append(entry)
            print(f"[{len(entries)}/{len(todo)}] {entry['kind']} {entry['family']}: "
                  f"{entry['status']} {entry.get('why', '')[:120]} ({entry['seconds']} s)",
                  file=sys.stderr, flush=True)
            if args.json:
                with open(args.json, "a") as out:
                    out.write(json.dumps(entry) + "\n")
    entries.sort(key=lambda e: (e["kind"], e["family"]))
    print(table(entries, [column(b, d) for b in backends for d in dtypes] + ["inference"]))


if __name__ == "__main__":
    main()
