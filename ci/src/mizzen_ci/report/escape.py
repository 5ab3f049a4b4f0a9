"""The health page's one escaping function, :func:`e`: every text the page shows (page and
sparkline titles alike) goes through it, and through nothing else.

Invariants, in this order:
- the process-wide mask set (:func:`mizzen_ci.masking.mask`) is applied first, to the text as it
  was given, as every escaping function of :mod:`mizzen_ci.output` does: escaping first would
  turn a secret ``a&b<c`` into ``a&amp;b&lt;c``, a form the mask set does not hold;
- a code point UTF-8 cannot encode (a lone surrogate: a path's undecodable byte, say) is shown
  as ``\\udcff``, so the page can always be written as UTF-8;
- then :func:`html.escape`, quotes included: the result is inert in text and in quoted attributes.
"""

from __future__ import annotations

import html
import re

from .. import masking

_SURROGATE = re.compile("[\ud800-\udfff]")


def e(text: object) -> str:
    """``text`` masked, with lone surrogates shown as code points, then HTML-escaped."""
    s = masking.mask(text)
    if not s.isascii():
        s = _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", s)
    return html.escape(s, quote=True)
