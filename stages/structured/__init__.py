"""Structured outputs (docs/architecture.md §11): the request's parameters (``params``), the
grammar backend protocol (``backend``), its llguidance backend (``llguidance``), the bounds a
grammar must fit before it compiles (``limits``) and the manager the schedule stage drives
(``manager``). No torch here: the token mask is applied by the execute stage
(:mod:`stages.execute.grammar_mask`)."""
