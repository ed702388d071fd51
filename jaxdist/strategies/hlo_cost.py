"""Which mixture-of-experts dispatch path a compiled program took, read from its op names.

(The FLOP, byte and collective counts of a compiled program live in `jaxdist.costs`.)
"""

from __future__ import annotations

import re

__all__ = ["MOE_SCOPE", "moe_dispatch"]

MOE_SCOPE = "jaxdist_moe_"
"""The prefix of the named scope a mixture-of-experts layer runs in (``jaxdist_moe_<dispatch path>``): the
compiled module's op names say which dispatch path a program took (`moe_dispatch`)."""


def moe_dispatch(text: str) -> tuple[str, ...]:
    """The dispatch paths of the mixture-of-experts layers in a compiled module's ``text``, by their named scope
    (`MOE_SCOPE`): e.g. ``("dropping_all_to_all",)``; empty for none.

    Examples:
        >>> moe_dispatch('%a = f32[2] add(...), metadata={op_name="jit(f)/jaxdist_moe_dropless_padded/add"}')
        ('dropless_padded',)
    """
    return tuple(sorted(set(re.findall(re.escape(MOE_SCOPE) + r"(\w+)", text))))
