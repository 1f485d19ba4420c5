"""The writer actor (:mod:`.actor`) and the plain classes it is a shell over: the rank's NIXL
calls (:mod:`.poster`) and the WRITEs they make (:mod:`.writes`), remote ranks (:mod:`.links`,
:mod:`.remotes`), notifications in and out (:mod:`.inbound`, :mod:`.outbound`), what D awaits
(:mod:`.answers`), when to poll (:mod:`.cadence`, :mod:`.timerslack`), and P's pushes
(:mod:`.push`)."""
