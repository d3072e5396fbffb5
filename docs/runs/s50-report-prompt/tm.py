"""Scratch: icecache CLI where the sparse prefill's tail steps (the prompt's last tokens, run as
decode steps) attend to no selected pages: sink + pinned passages + window only."""
import os, sys
import torch
from icecache.cache import ice_layer as il
CUR = {}
orig_attend = il.IceLayer.attend
def attend(self, query, scale):
    CUR.clear()
    if query.shape[1] == 1 and self.length <= self.tail_end and os.environ.get("TM", "1") != "0":
        CUR["me"] = self
    return orig_attend(self, query, scale)
il.IceLayer.attend = attend
def wrap(f):
    def g(q, k, v, valid, *rest):
        me = CUR.get("me")
        if me is not None:
            r = me.resident
            cut = (r.pool_pages - r.pinned_slots) * r.page_size
            if os.environ.get("TM", "1") == "gap":
                k = k.clone(); k[:, : r.pool_at + cut] = me.remap.frame.rotate(k[:, : r.pool_at + cut], 2048, 0)
            else:
                valid = valid.clone(); valid[:, r.pool_at : r.pool_at + cut] = False
        return f(q, k, v, valid, *rest)
    return g
il.paged_decode_sdpa = wrap(il.paged_decode_sdpa)
il.paged_decode_rest = wrap(il.paged_decode_rest)
il.paged_decode_weighted = wrap(il.paged_decode_weighted)
QAP = os.environ.get("QAP")
if QAP:
    from icecache import prompts as _pr
    PROMPTS = {
        "p1": "Answer the question based on the document above, as concisely as you can, in a single phrase or sentence.\n\nQuestion: {q}\nAnswer:",
        "p4": "Using the document above, answer the question below as briefly as possible: one phrase or one sentence.\n\nQuestion: {q}\nAnswer:",
        "p0": "Answer this question about the document above: {q}",
        "p5": "Using the document above, answer the question below in one sentence.\n\nQuestion: {q}\nAnswer:",
        "p6": "Answer the question below from the document above.\n\nQuestion: {q}\nAnswer:",
        "p2": "Using only the document above, answer this question in one short sentence: {q}",
        "p3": "Question about the document above: {q}\nAnswer in one sentence that repeats the question's subject.",
    }
    def qa_messages(document, question):
        return [{"role": "user", "content": f"Here is a document.\n\n{document.strip()}\n\n" + PROMPTS[QAP].replace("{q}", question.strip())}]
    _pr.qa_messages = qa_messages
if __name__ == "__main__":
    from icecache_cli.app import main as app
    app(sys.argv[1:])
