"""One-off: where the device memory of two failing cuda tests goes (not committed)."""
import collections, gc, os, sys
import torch
sys.path.insert(0, "tests/cuda"); sys.path.insert(0, "tests")
import offload_adam
import test_engine_cuda as te
import test_param_stream_cuda as tp

def where(frames):
    keep = [f"{os.path.basename(f['filename'])}:{f['line']}:{f['name']}" for f in frames
            if ("offload_adam" in f["filename"] or "tests" in f["filename"])]
    return " < ".join(keep[:4]) or (frames[0]["filename"] + ":" + str(frames[0]["line"]) if frames else "?")

def active(snap):
    out = {}
    for s in snap["segments"]:
        addr = s["address"]
        for b in s["blocks"]:
            if b["state"] == "active_allocated":
                out[addr] = b
            addr += b["size"]
    return out

torch.cuda.memory._record_memory_history(max_entries=200000, stacks="python")
# 1: step's peak
model = te.make_model(width=2048)
opt = offload_adam.AdamW(model.parameters(), bucket_mb=1)
te.loss_of(model, 0).backward()
torch.cuda.synchronize()
torch.cuda.reset_peak_memory_stats()
before = torch.cuda.memory_allocated()
n0 = len(torch.cuda.memory._snapshot()["device_traces"][0])
opt.step(); torch.cuda.synchronize()
print("STEP peak over before:", torch.cuda.max_memory_allocated() - before)
tr = torch.cuda.memory._snapshot()["device_traces"][0][n0:]
live = 0
for e in tr:
    if e["action"] in ("alloc", "free_requested"):
        live += e["size"] if e["action"] == "alloc" else -e["size"]
        if e["size"] >= 1 << 19:
            print(f"  {e['action']:15s} {e['size']:>10d} live={live:>10d} stream={e.get('stream')} {where(e['frames'])}")
del model, opt
# 2: held after a run, resident vs streamed
held = {}
for streamed in (False, True):
    gc.collect(); torch.cuda.synchronize(); torch.cuda.empty_cache()
    snap0 = torch.cuda.memory._snapshot()
    ids0 = set(active(snap0))
    base = torch.cuda.memory_allocated()
    model, o, streamer, _ = tp.run(streamed)
    held[streamed] = torch.cuda.memory_allocated() - base
    snap = torch.cuda.memory._snapshot()
    groups = collections.Counter(); counts = collections.Counter()
    for addr, b in active(snap).items():
        if addr not in ids0:
            k = where(b.get("frames", []))
            groups[k] += b["size"]; counts[k] += 1
    print("RUN streamed=%s held=%d" % (streamed, held[streamed]))
    for k, v in groups.most_common(25):
        print(f"  {v:>10d} x{counts[k]:<5d} {k}")
    del model, o, streamer
print(held)
