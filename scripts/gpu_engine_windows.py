"""The engine's sliding windows on a GPU, with Gemma 3 270M: what the CPU tests cannot check.

Usage (on the GPU machine, after ``KV_MODELS=gemma3 source scripts/offline_gpu_env.sh``, with a prefix bank of
Gemma boundaries, e.g. the one ``scripts/gpu_gemma_trial.sh`` leaves)::

    python3 scripts/gpu_engine_windows.py OUTDIR --bank /tmp/kv/ledgers/gemma/prefix_bank_bf16.jsonl \
        [--batch 16] [--fp32-rows 4] [--budget SECONDS]

(``--device cpu --caps 8 8 4`` is a dry run of the code paths: the engine's eager step, the reference
FlexAttention, short suffixes.)

The boundaries of the ``gemma`` profile's caps are thousands of positions long, so Gemma's sliding layers (window
512) read from a block past the first and the compiled kernels follow a block list that moves every step.
Sections, each recorded in ``OUTDIR/engine_windows.json`` after it runs (one that raises is recorded with its
error, and the next runs):

* ``graph_equals_eager``: BF16 suffixes of the bank's boundaries (repeated to ``--batch``) at the profile's caps,
  ``flex`` on the graph path, every step re-run by the eager step and required equal bit for bit (gate
  ``graph_equals_eager``); then the whole decode on the eager path against the graph path's, and the first
  boundary alone in the last slot against its run with companions.
* ``tolerance``: the ``attention_tolerance`` gate on a real boundary, ``flex`` and ``grouped``, BF16 and FP32:
  each layer's kind and relative error against math SDPA in float64, and the sliding block mask's first block.
* ``fp32_tokens``: ``--fp32-rows`` boundaries in FP32 (the model loaded in float32): the eager decoders' suffix
  (``kvreplay.decode.decode_suffix``) against the ``flex`` engine's on the graph path, token for token.

Nothing about outcomes is asserted: gates raise and are recorded, every comparison is a count.
"""

from __future__ import annotations

import dataclasses

import argparse
import json
import os
import time
import traceback
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402

T0 = time.perf_counter()
SECTIONS = ("graph_equals_eager", "tolerance", "fp32_tokens")


def elapsed() -> float:
    return round(time.perf_counter() - T0, 1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--bank", type=Path, required=True, help="a prefix bank of Gemma 3 boundaries (prefix_bank_bf16.jsonl)")
    ap.add_argument("--profile", default="gemma", help="the profile whose model, format and caps are used")
    ap.add_argument("--batch", type=int, default=16, help="problems per step (the bank's boundaries repeated)")
    ap.add_argument("--fp32-rows", type=int, default=4, help="boundaries of the fp32_tokens section")
    ap.add_argument("--budget", type=float, default=300.0, help="seconds; no section starts after it")
    ap.add_argument("--only", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (a dry run)")
    ap.add_argument("--caps", type=int, nargs=3, default=None, metavar=("BRANCH", "MERGE", "ANSWER"),
                    help="the suffixes' caps (default the profile's)")
    args = ap.parse_args(argv)
    cuda = args.device.startswith("cuda")
    graph = "graph" if cuda else "eager"
    args.out.mkdir(parents=True, exist_ok=True)

    import dataclasses

    from kvreplay import caches, decode, engine
    from kvreplay.contract import MERGE, Caps
    from kvreplay.ledger.prefix_bank import read_prefix_bank
    from kvreplay.profiles import load_parameters
    from kvreplay.runner import ArmSettings

    p = load_parameters(args.profile)
    caps = Caps(*(args.caps or (p.cap_branch, p.cap_merge, p.cap_answer)))
    settings = ArmSettings(profile=args.profile, dtype="bfloat16", caps=caps, model=p.model, fmt=p.format, threads=4,
                           device=args.device, step_path="graph" if cuda else "engine-eager", batch=args.batch,
                           attention="flex")
    lm, fmt = settings.load()
    layout = lm.layout
    entries, bank_sha = read_prefix_bank(args.bank)
    prefixes = [entries[i % len(entries)]["prefix"] for i in range(args.batch)]
    states = [decode.build_prefill(lm, fmt, z, where=f"bank {i}") for i, z in enumerate(prefixes)]
    max_len = -(-(max(map(len, prefixes)) + engine.suffix_length_bound(fmt, caps)) // 128) * 128
    run = engine.EngineRun(batch=args.batch, max_len=max_len, attention="flex")
    res: dict = {"device": torch.cuda.get_device_name() if cuda else "cpu (dry run)", "model": p.model,
                 "layer_kinds": layout.kinds(), "window": layout.window, "caps": list(dataclasses.astuple(caps)),
                 "boundaries": {"bank": str(args.bank), "sha256": bank_sha, "distinct": min(len(entries), args.batch),
                                "lengths": sorted({len(z) for z in prefixes}), "max_len": max_len},
                 "load_s": elapsed(), "sections": {}}
    path = args.out / "engine_windows.json"

    def dump() -> None:
        path.write_text(json.dumps(res, indent=1, sort_keys=True, default=str) + "\n")

    def same(a, b) -> bool:
        return (a.tokens, a.margins) == (b.tokens, b.margins)

    def graph_equals_eager() -> dict:
        t = time.perf_counter()
        verified = dataclasses.replace(run, step_path=graph, verify_steps=100_000).measured()
        g = engine.decode_suffixes(lm, fmt, states, caps, run=verified)
        checked, seconds = verified.stats.verified_steps, time.perf_counter() - t
        e = engine.decode_suffixes(lm, fmt, states, caps, run=dataclasses.replace(run, step_path="eager"))
        alone = engine.decode_suffixes(lm, fmt, states[:1], caps, run=dataclasses.replace(run, step_path=graph, fill_from="last"))[0]
        return {"steps_checked_bit_for_bit": checked, "seconds_with_checks": round(seconds, 1),
                "eager_path_equal": sum(same(a, b) for a, b in zip(g, e)), "of": len(g),
                "alone_in_the_last_slot_equal": same(g[0], alone), "suffix_tokens": [len(s.tokens) for s in g]}

    def tolerance() -> dict:
        out = {}
        lm32 = model32()
        for dtype, model in (("bfloat16", lm), ("float32", lm32)):
            b = states[0] if model is lm else decode.build_prefill(lm32, fmt, prefixes[0], where="bank 0")
            for attention in ("flex", "grouped"):
                eng = engine.StepEngine(model, fmt, 1, max_len, "eager", attention=attention)
                n = eng.admit(0, b.cache, b.roles)
                eng.set_row_pair(0, int(b.logits[0].argmax()), n, MERGE, MERGE)
                rec = eng.check_attention("bank 0")
                out[f"{dtype}/{attention}"] = {"max_rel_err": rec["max_rel_err"], "tolerance": rec["tolerance"],
                                               "rel_err_by_layer": dict(zip(
                                                   [f"{i}:{k}" for i, k in enumerate(layout.kinds())],
                                                   rec["rel_err_by_layer"])), "position": n}
                if attention == "flex" and "sliding_attention" in eng._flex:
                    out[f"{dtype}/{attention}"]["sliding_first_block"] = int(
                        eng._flex["sliding_attention"].first_block[0])
        return out

    fp32: list = []

    def model32():
        """The model loaded in float32 (as the FP32 arms load it: not an upcast of the BF16 weights)."""
        if not fp32:
            fp32.append(dataclasses.replace(settings, dtype="float32").load()[0])
        return fp32[0]

    def fp32_tokens() -> dict:
        lm32 = model32()
        zs = prefixes[: args.fp32_rows]
        built = [decode.build_prefill(lm32, fmt, z, where=f"bank {i}") for i, z in enumerate(zs)]
        t = time.perf_counter()
        want = [decode.decode_suffix(lm32, fmt, caches.live_replica(s), caps) for s in built]
        eager_s = time.perf_counter() - t
        got = engine.decode_suffixes(lm32, fmt, built, caps, run=dataclasses.replace(run, step_path=graph, batch=len(zs)))
        return {"tokens_equal": sum(a.tokens == b.tokens for a, b in zip(got, want)), "of": len(zs),
                "first_difference": [next((i for i, (x, y) in enumerate(zip(a.tokens, b.tokens)) if x != y), None)
                                     for a, b in zip(got, want)],
                "eager_decoder_s": round(eager_s, 1)}

    for name, fn in (("graph_equals_eager", graph_equals_eager), ("tolerance", tolerance),
                     ("fp32_tokens", fp32_tokens)):
        if name not in args.only:
            continue
        if elapsed() > args.budget:
            res["sections"][name] = {"skipped": f"budget {args.budget} s spent"}
            continue
        t = time.perf_counter()
        try:
            res["sections"][name] = fn() | {"seconds": round(time.perf_counter() - t, 1)}
        except Exception as e:  # recorded; the next section runs
            res["sections"][name] = {"error": f"{type(e).__name__}: {e}"[:2000],
                                     "traceback": traceback.format_exc()[-3000:]}
        print(name, json.dumps(res["sections"][name], default=str)[:1500], flush=True)
        dump()
    res["elapsed_s"] = elapsed()
    dump()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
