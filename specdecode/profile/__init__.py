"""The machine's cost profile (``specdecode profile``): what a target forward of n tokens costs against one
token (``v(n)``), what a draft step costs against a target step (``c``), where speculation breaks even and
the most exact speculation can gain, per backend, measured here and cached per machine and model files.

A tool: the library core never imports it. ``--backend auto`` and the auto policy read a stored profile
through :func:`cached` or :func:`decode_speeds` (they measure nothing); :meth:`Profile.v` is the per-width table and
:meth:`Profile.verify_grid` the same in :mod:`specdecode.costmodel`'s grid form.
"""

from specdecode.profile.cache import cached, decode_speeds, store
from specdecode.profile.result import Machine, ModelCost, Profile

__all__ = ["Machine", "ModelCost", "Profile", "cached", "decode_speeds", "store"]
