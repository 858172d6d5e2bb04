"""tpsim's benchmark suite: what tpsim costs, as ratios against things measured beside it in one run.

Run it with one command from the repository root::

    python -m bench            # full run (~15 min), writes docs/bench.md, docs/bench.json, docs/bench_*.png
                               # and the README's "Performance" section (tests check the two agree)
    python -m bench --quick    # a tiny configuration (seconds), e.g. ``--out /tmp/b``

Sections (see ``docs/bench.md`` for the tables they produce):

- ``step``: the collective-step workload (a column-linear forward+backward loop, one all_gather
  and one all_reduce per step) vs world size, on inproc, torch's internal threaded process group
  (comparison only; imported here and nowhere else), gloo and two single-thread references: the
  floor (every rank receives the collectives' results) and compute (results built once, for nobody);
  floor, compute and inproc run interleaved in one process per world size, fastest of several runs;
- ``props``: property examples per second per backend, gloo world start-up vs per-example cost, and
  inproc isolated (what ``tpsim check`` runs) measured side by side with plain inproc on the same
  cases (``python -m bench --only props --out DIR`` runs just this section);
- ``mutants``: examples and seconds for the search to catch every mutant in ``tpsim.mutants.CATALOG``
  (read when the section runs, so new mutants appear without a change here);
- ``labmlp``: the lab-note MLP (hidden 4096, intermediate 11008, tp 2, float32) checked on inproc vs
  the dense MLP's own forward+backward: the plain gelu MLP and the gated (swiglu) one with sequence
  parallelism;
- ``faults``: fault detection latency per fault kind and backend;
- ``memory``: peak resident memory of an inproc world vs the dense reference (fresh subprocesses);
- ``dtensor``: per-example time of the DTensor adapters on inproc vs gloo;
- ``checks``: what a user waits for: ``tpsim check`` end to end in fresh processes (tpsim's column
  layer at world sizes 1-4 and at the default ones, the Megatron-core preset), on inproc (isolated, as
  by default, and not), and gloo, interleaved, with the gloo worker pools each run replaced; every
  goal with its measure. It writes the "What you wait for" paragraph the README quotes;
- ``overhead``: inproc's cost per collective per rank with tiny tensors at world sizes 8, 32 and 128,
  beside its floor measured in the same process (a thread hand-off per rank: the cheaper of a ring of
  plain locks and the same ring placed as inproc places its rank threads; plus torch's own
  ``dist.all_reduce`` wrapper, on a one-rank gloo world); ``python -m bench --only overhead --out DIR``
  runs just this section (about a minute), ``python -m bench.overhead 8,32,128 300 5`` prints its JSON;
- ``scale``: a whole check (``check_case``: float64 reference, tp world, every property) of tpsim's
  SwiGLU MLP (hidden 512..4096, ffn in the lab note's proportion), vocab-parallel embedding and
  cross-entropy (vocab 4096..32000) against the same layer's dense forward+backward and against the
  floor of any such check (drawing the case's values and one float64 dense forward+backward, in
  plain torch), side by side in one fresh process per size; the ratios, and a plot of check time
  against size.

A change's cost in examples/s, against the commit it started from (``git archive BASE | tar -x -C
DIR``), side by side: ``python -m bench.compare DIR`` (:mod:`bench.compare`; not part of the report).

Every measurement that could hang or run long runs in a subprocess with a time limit; a limit hit is
reported as ``> limit`` and larger sizes of that series are skipped. The document records the load
average at the start and end of the run (the machine may be shared).

``tox -e bench`` runs the same command (``tox -e bench -- --quick`` passes options through).
"""
