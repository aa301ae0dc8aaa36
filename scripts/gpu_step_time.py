"""Step time on a GPU: the live decoder's forward calls vs Hugging Face ``generate``, then a cProfile of one Experiment 1 row.

Usage (on the GPU machine, after ``source scripts/offline_gpu_env.sh``):
``python3 scripts/gpu_step_time.py THREADS``. Its output on the lent H200 is
``data/device/h200/step_time.txt``.
"""
import cProfile, pstats, time, torch, sys
from kvreplay.contract import Caps
from kvreplay.problems import load_bank
from kvreplay.experiments.live_vs_prefill import live_vs_prefill_row
from kvreplay.runner import ArmSettings, RunSpec
from kvreplay import decode
s = ArmSettings(profile="p", dtype="bfloat16", caps=Caps(16, 32, 4), device="cuda", threads=int(sys.argv[1]))
lm, fmt = s.load()
print("device", lm.device, next(lm.model.parameters()).dtype, torch.get_num_threads())
p = load_bank()[0]
spec = RunSpec(lm=lm, fmt=fmt, decoding=s.decoding)
live_vs_prefill_row(spec, p)
torch.cuda.synchronize(); t = time.perf_counter(); calls0 = lm.calls
live = decode.decode_live(lm, fmt, fmt.prompt_ids(p.question, p.options), s.caps)
torch.cuda.synchronize(); dt = time.perf_counter() - t
print(f"decode_live: {lm.calls - calls0} calls in {dt:.2f} s = {1000 * dt / (lm.calls - calls0):.1f} ms/call")
ids = torch.tensor([live.ids, live.ids], device=lm.device)
with torch.inference_mode():
    lm.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    torch.cuda.synchronize(); t = time.perf_counter()
    lm.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=64, min_new_tokens=64, do_sample=False, pad_token_id=0)
    torch.cuda.synchronize(); print(f"generate 64 tokens: {1000 * (time.perf_counter() - t) / 64:.1f} ms/token")
pr = cProfile.Profile(); pr.enable(); live_vs_prefill_row(spec, p); pr.disable()
pstats.Stats(pr).sort_stats("tottime").print_stats(22)
