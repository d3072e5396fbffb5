"""Generated documents: seeded, varied English prose for benchmarks, evaluation fillers and tests
(no downloads)."""

from __future__ import annotations

import numpy as np

SUBJECTS = ["The harbor board", "Our lead engineer", "The city council", "A local farmer", "The museum",
            "The northern ferry", "Professor Lindqvist", "The river pump station", "The bakery on Elm Street",
            "The rail company", "Our finance team", "The school choir", "A visiting botanist"]
VERBS = ["reported", "decided", "noticed", "measured", "announced", "argued", "confirmed", "estimated"]
OBJECTS = ["that the spring floods reached {n} centimeters", "a budget of {n} thousand euros for repairs",
           "that {n} visitors came in the first week", "a delay of {n} days on the bridge project",
           "that the new lamp lasts {n} hours", "a harvest of {n} tonnes of barley",
           "that the old pier is {n} years old", "{n} complaints about the night buses",
           "a rise of {n} percent in ticket sales", "that the well is {n} meters deep"]
TAILS = ["", " Nobody expected this.", " The minutes were sent to every member.",
         " A second review is planned for autumn.", " The weather made the work harder.",
         " This matches last year's figures.", " Several residents disagreed."]


def generated_text(num_words: int, seed: int = 0) -> str:
    """Seeded, varied English prose of about ``num_words`` words (no downloads)."""
    rng = np.random.default_rng(seed)
    out, words = [], 0
    while words < num_words:
        s = (f"{SUBJECTS[rng.integers(len(SUBJECTS))]} {VERBS[rng.integers(len(VERBS))]} "
             + OBJECTS[rng.integers(len(OBJECTS))].format(n=int(rng.integers(2, 999)))
             + "." + TAILS[rng.integers(len(TAILS))])
        out.append(s)
        words += len(s.split())
        if rng.random() < 0.15:
            out.append("\n\n")
    return " ".join(out)
