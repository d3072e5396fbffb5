"""Scratch dev suite: long_report documents (seeds) at TOKENS; qa of the three facts under
variants of tm.py (TM=0 shipped, 1 tail steps read no pages, gap: tail pages 2048 back)."""
import json, os, subprocess, sys, time
sys.path.insert(0, "/work/main/scripts")
from long_report import FACTS, document, found
tokens = int(sys.argv[1]); seeds = [int(s) for s in sys.argv[2].split(",")]; variants = sys.argv[3].split(",")
extra = sys.argv[4:]
for seed in seeds:
    d = f"/tmp/s50/dev{tokens}-{seed}"; os.makedirs(d, exist_ok=True)
    doc = f"{d}/report.txt"
    if not os.path.exists(doc):
        open(doc, "w").write(document(tokens, seed))
    qs = [x for _s, _f, q, _a in FACTS for x in ("-q", q)]
    for v in variants:
        t0 = time.time()
        tmv, more = (v, []) if not v.startswith("b") else ("0", ["--budget", v[1:]])
        qap = ""
        if v.startswith("p"):
            tmv, qap = "0", v
        r = subprocess.run([sys.executable, "/tmp/s50/tm.py", "qa", doc, *qs, "--max-new-tokens", "24", "--doc-cache", f"{d}/cache", "--json", *extra, *more],
                           capture_output=True, text=True, env={**os.environ, "TM": tmv, "QAP": qap}, cwd="/work/main")
        if r.returncode:
            print("FAIL", seed, v, r.stderr[-500:]); continue
        out = json.loads(r.stdout)["output"]
        hits = [found(a, f[3]) for a, f in zip(out, FACTS)]
        print(json.dumps({"tokens": tokens, "seed": seed, "variant": v, "hits": hits, "s": round(time.time() - t0), "answers": out}), flush=True)
