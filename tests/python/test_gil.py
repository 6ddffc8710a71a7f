"""Blocking calls release the GIL: other Python threads run while a learner waits to join."""
import threading

import ddiloco
from conftest import Tiny


def test_another_thread_makes_progress_while_join_waits_for_a_syncer_not_serving_yet(syncer_of):
    model = Tiny()
    s = syncer_of(model, fragments=3, start=False)   # bound, not answering
    ln = ddiloco.Learner(model, endpoint=s.endpoint, id=0, plaintext=True, fragments=3, join_timeout=60,
                         join_retry=0.05)
    joined, failure = threading.Event(), []

    def join():
        try:
            ln.join()
            joined.set()
        except BaseException as e:
            failure.append(e)
            joined.set()

    t = threading.Thread(target=join)
    t.start()
    # Pure-Python work on this thread while join blocks on the other: it can only
    # proceed if join released the GIL. The syncer starts once it has.
    count = 0
    while count < 200_000 and not joined.is_set():
        count += 1
    assert count == 200_000 and not joined.is_set(), "join returned before the syncer served"
    s.start()
    assert joined.wait(60) and not failure, failure
    t.join()
    assert ln.joined and s.status()["joins"] == 1
    ln.close()
