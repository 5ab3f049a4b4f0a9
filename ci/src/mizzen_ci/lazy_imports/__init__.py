"""The lazy-import invariant: importing any workspace module on a CPU image loads nothing its
package's budget forbids.  Rooms: :mod:`.policy` (the one table, in the root ``pyproject.toml``),
:mod:`.static` (the module-scope import graph, chains shown), :mod:`.runtime` with its child
:mod:`.probe` (every module imported with the forbidden ones blocked), :mod:`.walk` (import every
module of an installed package; also used by ``nox -s packages``) and :mod:`.cli`
(``mizzen-ci lazy-imports``).
"""
