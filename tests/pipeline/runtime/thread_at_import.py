"""A module that starts a thread as it is imported (tests/pipeline/runtime/test_zygote.py: a
zygote that imports it must not fork)."""

import threading
import time

threading.Thread(target=time.sleep, args=(3600,), daemon=True, name="started-at-import").start()
