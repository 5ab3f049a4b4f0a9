"""The planner's speed-only caches: skippable on a first read, because a plan made with them
equals the plan made without them (``--no-cache``).

Rooms: :mod:`.source_facts` (one parse per file: imports and registration syntax),
:mod:`.facts_cache` (those facts by content hash, with a stat index and parallel cold reads),
:mod:`.spelled_names` (which files cannot name a module, read from their bytes),
:mod:`.lazy_reach` (the reach index with unparsed nodes parsed on demand) and :mod:`.build` (the
index of a tree: registry plus reach, kept warm between runs).
"""

from .build import CACHE_FILE, PlanIndex, build_index

__all__ = ["CACHE_FILE", "PlanIndex", "build_index"]
