"""actorline-lpf: a "longest prompt first" scheduling policy, an ``actorline.schedulers``
plugin (see the package README)."""

from actorline_lpf.policy import LongestPromptFirstPolicy

__all__ = ["LongestPromptFirstPolicy"]
