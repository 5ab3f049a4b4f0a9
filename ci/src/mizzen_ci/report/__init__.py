"""The CI health page: one static HTML file rendered from the history store.

Rooms: :mod:`.records` (the kinded records the page reads beside durations, flake records and
the metric store: ``pool``, ``queue``, ``audit``; their shapes and the one writer of ``pool``
records from a plan), :mod:`.collect` (everything the page shows, computed from the store),
:mod:`.escape` (the page's one escaping function: masked, then HTML-escaped), :mod:`.svg`
(inline SVG sparklines), :mod:`.page` (the HTML) and :mod:`.cli` (``mizzen-ci report --html
DIR``, ``mizzen-ci report --record-plan PLAN``).

Invariants:
- Stdlib only at import time (``python3 -S``); the page needs no JavaScript and loads nothing
  (its Content-Security-Policy allows inline styles only): one self-contained ``index.html``.
- Everything shown comes from stores read with :mod:`mizzen_ci.history`'s bounded readers or
  the metric store's checked reads, and is masked, then escaped (:mod:`.escape`); a dropped
  line is listed on the page and on stderr, never silently.
- Collecting is a pure function of the store, the checkout and the time given; rendering is a
  pure function of what was collected.
"""
