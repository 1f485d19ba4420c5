"""P's pushes on the writer's thread: the book of pushes and their targets (:mod:`.book`), the
three ways a push is posted (:mod:`.direct`, :mod:`.staged`, :mod:`.layered`, each built with
:class:`~.posting.Posting` and returning an :mod:`.outcome`), and the :class:`~.pusher.Pusher`
that alone applies what they return, settles, expires and cancels."""
