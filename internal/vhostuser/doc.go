// Package vhostuser is the daemon's vhost-user back end: it reads the front
// end's (QEMU's, Cloud Hypervisor's) messages from the unix socket, negotiates
// features, maps guest memory regions, sets up one virtqueue.Queue per ring
// and serves each enabled ring with its own server goroutines, which pop
// chains, hand each to a RequestHandler (the FUSE layer), push the result
// and signal the guest.
//
// Every message is checked before it changes state. A message the back end
// cannot honour is refused (an error reply when the front end asked for one,
// a log line otherwise) and the connection goes on; only a stream that is
// out of step (bad version bits, a truncated or absurd payload) or gone ends
// it. When the front end disconnects, Serve stops every ring, waits for the
// requests in flight, unmaps guest memory and returns nil.
//
// # Scheduling
//
// Each started and enabled ring has up to 1+W servers (runner.go): W is
// the worker budget, --thread-pool-size (default: one fewer than the
// CPUs), shared by all rings; the hiprio ring has W = 0.
//
// Who blocks where. A server is serving a request; or watching: asleep
// in ppoll(2) on the ring's kick eventfd (kick.go), at most one per ring;
// or parked on its own channel; or waiting for the VMM's answer on the
// back-end channel (an FS_IO bounce, a DAX window's map: channel.go,
// window.go), which a ring stop cancels. Nothing else blocks: there is no
// dispatcher, no queue between goroutines and no lock shared by rings.
//
// Who serves which request. A server holds the ring's mutex only to pop:
// it takes the next chain into its own slot, lets go, serves it, pushes the
// reply, and pops again. A request is served start to finish by the server
// that popped it, on that server's thread, so a busy ring hands nothing
// from thread to thread. A server that finds the ring empty watches, if no
// server does: it re-enables kicks, looks once more (a chain may have
// beaten the re-enable) and sleeps; else it parks. A server that pops a
// heavy request (a READ or WRITE of 32 KiB or more: Classify) while more
// chains wait wakes one parked server, if the budget has a unit left,
// unless it writes the file the ring's last large write wrote (a second
// server would only wait for the file's lock). The units belong to the
// ring, not to the server woken: as its servers park, the ring gives back
// those beyond one fewer than its servers awake. Small requests stay on
// one server: waking another costs more than it saves.
//
// When the guest is signalled. A server signals (Queue.Notify: with
// EVENT_IDX, only if the guest asked) for the replies it pushed once they
// are at least as many as the chains waiting in the ring, and always
// before it watches, parks or exits. One request at a time, that is every
// reply at once; with a queue of requests, the guest hears when half of
// it is done, in time to refill it, and a guest that refills at once is
// signalled about once per half queue. A request Classify marks slow (an
// fsync) first signals the replies before it.
//
// Stopping. GET_VRING_BASE (and reset, disconnect) sets the ring
// stopping, interrupts the watcher, wakes the parked servers and waits for
// every server to finish the request it holds and exit: the ring's base
// (split: its avail index; packed: both indices and wrap counters) is then
// exact. Before it waits it cancels any FS_IO bounce or window map,
// whose VMM answers only after the message that stops the ring is
// answered.
// Memory and call fd changes need no stop: chains are translated with a
// referenced table (the newest at each look at the ring), and the Queue
// swaps the call fd under its own lock.
//
// Tunables: heavyBytes (internal/fuse, 32 KiB) decides which requests
// wake a second server: the 1 MiB rows of make bench need one, the 4 KiB
// rows are faster without. pollInterval serves a ring whose front end
// sent no kick fd; no benchmark row needs it, and QEMU never does that.
//
// # Counting rules
//
// A ring's runner keeps, under its lock, its servers, the parked ones
// (with those never started, which lie under them and start lowest index
// first), how many servers are awake and how many live (goroutines), the
// worker budget units the ring holds (extras) and whether one watches; the
// back end counts the units all rings hold (busyWorkers). No server exits
// before the ring stops, and until then parked + awake = servers and a
// server is awake (serving or watching). live = awake + the parked servers
// that started; 0 ≤ extras ≤ awake − 1, and extras ≤ busyWorkers; a parked
// server holds no memory table and no wake-up; and with every serving
// ring's lock held, busyWorkers = the rings' extras ≤ Workers. rules.go
// checks them in -race builds (every test of the project, and the daemon
// the integration tests build) and with -tags schedcheck, each time a
// runner's lock is released, that is after every transition, and panics
// naming the rule and the counts; the release binary has none of it.
//
// # Rationale
//
// Figures from this project's 2-CPU machine (make bench; README,
// Performance).
//
// The watcher sleeps in ppoll on its server's thread: through Go's
// netpoller a kick wakes the poller's thread, which then runs the
// scheduler to find and resume the server; on a guest doing 4 KiB requests
// one at a time, that extra work is CPU taken from its vCPUs.
//
// A P per ring watched (Config.RingsWatched; cmd/govirtiofsd sets
// GOMAXPROCS). A thread asleep in a system call still holds its P. With no
// idle P left, sysmon takes it away after 20 µs and hands it to a fresh
// thread, and the sleeper must win a P back when it wakes: on the metadata
// cycle that was 61k context switches a second against 13k. The Ps grow
// when a ring is first started, to the most rings any back end of the
// process started, and are never given back: changing GOMAXPROCS stops the
// world, and a world stop on the message loop after a stopped ring's
// servers exited had not completed after 10 s, twice in about 56,000
// connections of the bench's front end (GET_VRING_BASE unanswered, Go
// 1.26), when every start and stop changed it. QEMU sets up every ring
// before it enables the first, so the few changes left come before any
// server runs. They are not reserved up front for every ring a back end
// may have: each P has its own allocation caches and garbage collector
// worker, and the default 255 request queues took the idle daemon from 3
// to 10 MiB of anonymous memory.
//
// The watcher yields once per wait (runtime.Gosched). The runtime takes a
// goroutine that has run on one scheduler tick for 10 ms for a hog: it
// preempts it, takes its P while it sleeps in a system call, and then
// polls every 20 µs for a while. A server that only ever sleeps in ppoll
// and serves never passes through the scheduler. The yield costs a
// fraction of a microsecond; without it the runtime's monitor preempted
// the server's thread thousands of times a second on the depth-1 rows
// (about 2,300: README, Parallelism under vhost-user behaviour). The
// yield is not free: the runtime wakes an idle thread to look for work,
// which spins and sleeps again, about a third of the daemon's CPU time on
// a depth-1 LOOKUP walk. Yielding at most every 4 ms saved that, but that
// spin also keeps the CPU awake for the next kick: without it randwrite
// 4k on one queue lost about 10% and the depth-1 walk's rate fell, so the
// yield stays per wait.
package vhostuser
