"""The recorder behind :class:`stepprof.Profiler`.

Data flows one way: the training thread's boundaries (:mod:`.boundaries`) queue each
finished step; the collector (:mod:`.collector`) turns completed steps into records and
hands them to the sinks (:mod:`.sinks`: the log and the summary).  Optional behaviour
(FLOP counting, memory records, the cross-rank exchange) plugs in as hooks (:mod:`.hooks`).
"""
