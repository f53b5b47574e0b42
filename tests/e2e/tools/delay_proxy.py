"""A TCP proxy on loopback that holds every chunk it relays for DELAY seconds:
a ring link with a long round trip (a relay, a far peer), for the e2e tests.
usage: delay_proxy.py LISTEN_PORT TARGET_PORT DELAY_S   (127.0.0.1 both)."""
import asyncio, sys
lport, dport, delay = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
async def pump(r, w):
    try:
        while True:
            d = await r.read(65536)
            if not d: break
            await asyncio.sleep(delay)
            w.write(d); await w.drain()
    except Exception: pass
    finally:
        try: w.close()
        except Exception: pass
async def handle(r, w):
    try:
        ur, uw = await asyncio.open_connection('127.0.0.1', dport)
    except Exception:
        w.close(); return
    await asyncio.gather(pump(r, uw), pump(ur, w))
async def main():
    s = await asyncio.start_server(handle, '127.0.0.1', lport)
    async with s: await s.serve_forever()
asyncio.run(main())
