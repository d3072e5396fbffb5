import sys, time, statistics, torch
from icecache.config import resolve_settings
from icecache.generation import Session
from icecache.models import load_model

def main():
    ctx = int(sys.argv[1]); mode = sys.argv[2]
    base = resolve_settings("cpu")
    loaded = load_model(None, base)
    text = " ".join(f"Entry {i}: the harbor office logged ship number {i * 37 % 1000} at dawn." for i in range(20000))
    ids = loaded.tokenizer(text)["input_ids"][:ctx]
    s = Session(loaded, base, "ice"); s.new_tokens = 200
    logits, _ = s.prefill(ids); tok = int(logits.argmax())
    for _ in range(8): tok = int(s.forward([tok]).argmax())
    ts=[]
    q0 = s.cache.stats.query_s
    for _ in range(24):
        t=time.perf_counter(); tok = int(s.forward([tok]).argmax()); ts.append(time.perf_counter()-t)
    print("median ms", round(statistics.median(ts)*1e3, 1), "query ms per token", round((s.cache.stats.query_s - q0) / 24 * 1e3, 2))
    if mode == "torch":
        from torch.profiler import profile, ProfilerActivity
        with profile(activities=[ProfilerActivity.CPU]) as p:
            for _ in range(16): tok = int(s.forward([tok]).argmax())
        print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=45))
    else:
        import cProfile, pstats
        pr = cProfile.Profile(); pr.enable()
        for _ in range(16): tok = int(s.forward([tok]).argmax())
        pr.disable(); pstats.Stats(pr).sort_stats("tottime").print_stats(45)
with torch.inference_mode(): main()
