"""What the graph kinds share: the raw capture recipe (``recipe``), the whole-step kinds' protocol backend
(``protocol``), per-layer capture schedules (``schedules``), call signatures (``args``), side streams
(``streams``), TE attention backend matching (``attention``), capture safety and the raw capture recipe's
error translation (``capture_safety``), padded-length buckets (``buckets``) and the one TE probe (``te``).
Nothing here knows an engine or a graph kind.
"""
