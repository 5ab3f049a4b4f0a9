"""Bisect a planned job: the first commit at which it fails, found by a binary search with
git bisect's step protocol in a scratch clone (:mod:`.scratch`: the user's tree is never touched), one step per commit
(:mod:`.step`), driven by :mod:`.cli` (``mizzen-ci bisect``)."""
