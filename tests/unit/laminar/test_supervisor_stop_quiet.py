"""`laminar-node up` ends without asyncio's "_GatheringFuture exception was never retrieved": the
future that wait() gathers the watchers into is cancelled by stop() on every normal stop, and that
outcome is consumed, not left for the garbage collector to report as an error."""
import asyncio
import gc
import sys

from laminar.supervisor import Child, Supervisor


def test_stop_after_wait_leaves_no_unretrieved_gather_error():
    code = "import os, sys, time; os.write(int(sys.argv[2]), b'READY\\n'); time.sleep(600)"
    child = Child("toy", "0", [sys.executable, "-c", code], ready_timeout_s=30)
    reported = []

    async def main():
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: reported.append(ctx.get("message")))
        sup = Supervisor([child], shutdown_s=5)
        await sup.start()
        waiting = asyncio.create_task(sup.wait())
        await asyncio.sleep(0.5)
        await sup.stop()
        await asyncio.wait_for(waiting, 30)
        del waiting, sup
        gc.collect()
        await asyncio.sleep(0)
    asyncio.run(main())
    assert child.state == "stopped"
    assert not [m for m in reported if m and "never retrieved" in m], reported
