"""A TCP proxy on loopback whose traffic a test can cut, as a network partition does.

While partitioned it forwards nothing, in either direction, on open or new connections, and
closes none: the peers see silence, not a reset (what a pulled cable or a dropping firewall
looks like; TCP would retransmit, so what was in flight arrives once the partition heals)."""

from __future__ import annotations

import asyncio
import contextlib
import threading

from rlmesh.runtime.net import free_port

CHUNK = 64 * 1024


class PartitionableProxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = free_port()
        self._loop = asyncio.new_event_loop()
        self._open = asyncio.Event()
        self._ready = threading.Event()
        self._server: asyncio.AbstractServer | None = None
        self._thread = threading.Thread(target=self._run, name=f"proxy-{self.port}", daemon=True)
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError(f"proxy on port {self.port} did not start")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def partition(self) -> None:
        self._loop.call_soon_threadsafe(self._open.clear)

    def heal(self) -> None:
        self._loop.call_soon_threadsafe(self._open.set)

    def close(self) -> None:
        async def stop() -> None:
            if self._server is not None:
                self._server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        with contextlib.suppress(RuntimeError):
            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)

        async def start() -> None:
            self._open.set()
            self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
            self._ready.set()

        self._loop.run_until_complete(start())
        self._loop.run_forever()

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            await self._open.wait()  # a connection made during a partition hangs until it heals
            target_r, target_w = await asyncio.open_connection(*self.target)
        except (OSError, asyncio.CancelledError):
            client_w.close()
            return
        pumps = [
            asyncio.ensure_future(self._pump(client_r, target_w)),
            asyncio.ensure_future(self._pump(target_r, client_w)),
        ]
        try:
            await asyncio.wait(pumps)
        except asyncio.CancelledError:
            pass  # close(): asyncio's server reports a cancelled handler as an error
        finally:
            for pump in pumps:
                pump.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(CHUNK):
                await self._open.wait()  # held, not dropped: TCP would retransmit it after the heal
                writer.write(data)
                await writer.drain()
            await self._open.wait()  # a close crosses the partition only once it heals, too
        except ConnectionError:
            pass
        finally:
            writer.close()
