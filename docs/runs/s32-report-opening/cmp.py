import torch
d = {n: torch.load(f"/tmp/s32/drift-{n}.pt") for n in ["A8full", "B8sparse", "C16", "D100"]}
# align by the common suffix of ids
ref = d["A8full"]["ids"]
def suffix(a, b):
    k = 0
    while k < min(len(a), len(b)) and a[-1-k] == b[-1-k]: k += 1
    return k
L = min(suffix(ref, d[n]["ids"]) for n in d)
print("common suffix", L)
Q = 25  # question+template tokens computed after the cached doc
for n in ["B8sparse", "C16", "D100"]:
    row_doc, row_q = [], []
    for l in range(30):
        a = d["A8full"]["v"][l][:, -L:].float(); b = d[n]["v"][l][:, -L:].float()
        cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)  # (H, L)
        row_doc.append(cos[:, :-Q].mean().item()); row_q.append(cos[:, -Q:].mean().item())
    print(n, "doc ", " ".join(f"{x:.2f}" for x in row_doc))
    print(n, "ques", " ".join(f"{x:.2f}" for x in row_q))
for n in d:
    lp = d[n]["lp"].float(); t = torch.topk(lp, 5)
    print(n, [(int(i), round(float(v), 2)) for v, i in zip(t.values, t.indices)])
# pairwise C16 vs D100
row=[]
for l in range(30):
    a = d["C16"]["v"][l][:, -L:].float(); b = d["D100"]["v"][l][:, -L:].float()
    row.append(torch.nn.functional.cosine_similarity(a, b, dim=-1)[:, -Q:].mean().item())
print("C16 vs D100 ques", " ".join(f"{x:.2f}" for x in row))
