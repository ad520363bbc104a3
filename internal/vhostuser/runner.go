package vhostuser

import (
	"errors"
	"fmt"
	"runtime"
	"runtime/debug"
	"sync"
	"sync/atomic"
	"time"

	"github.com/govirtiofsd/govirtiofsd/internal/bufvec"
	"github.com/govirtiofsd/govirtiofsd/internal/virtqueue"
)

// Classifier is implemented by request handlers that can tell, from a popped
// request, whether it is worth a second core.
type Classifier interface {
	// Classify peeks at request in without consuming it. heavy marks a
	// large READ or WRITE: its syscall dwarfs the cost of waking another
	// server goroutine, so the ring gets one while more chains wait.
	// writeNode is the node a heavy WRITE writes, 0 for any other
	// request: two large writes to one file would only contend for the
	// host inode's lock, so they are served one after the other by the
	// same server, whichever rings they arrive on. slow marks a request
	// that may take long whatever its size (an fsync): the replies pushed
	// before it are signalled first (notifyBatch).
	Classify(in *bufvec.Vec) (heavy bool, writeNode uint64, slow bool)
}

// slot is the state of one request in flight: its chain and the handler
// scratch that serves it. A ring's slots are allocated once, when it is
// first started; they move between the runner's free list, a server, and a
// server's backlog, which may be another ring's server's (claimLocked).
type slot struct {
	chain    *virtqueue.DescChain
	handler  RequestHandler
	classify Classifier // nil: every request is cheap
	// mem is the slot's own reference on the table its chain was
	// translated with, held only while the slot waits in a backlog or is
	// served from one (a server's chains otherwise live under the
	// server's reference).
	mem *virtqueue.GuestMemory
	// rn is the runner that popped the chain: its ring takes the reply,
	// and the slot back, even when another ring's server served it.
	rn *runner
	// urgent: Classify said heavy or slow (every deferred write is
	// heavy). Its reply is signalled at once (notifyBatch).
	urgent bool
	heavy  bool // Classify said heavy
	// behind is how many chains the ring's last snapshot held behind
	// this one when it was popped (holdBehind).
	behind uint16
}

// notifyBatch bounds how many cheap replies a server pushes before it
// signals the guest. A server signals when it has served every chain it saw
// in the ring's last snapshot, before it serves a heavy or slow request
// (and at once after), and before it parks or sleeps, so a reply waits at
// most for the cheap requests the guest had already queued behind it (a
// few microseconds each). One signal per batch rather than per request:
// with EVENT_IDX the guest asks for one whenever it has caught up, and
// each one is an interrupt and a thread wake-up in the guest.
const notifyBatch = 8

// A heavy reply is signalled at once unless the guest has queued at least
// holdBehind more chains behind its request than the server already holds
// replies for: then its signal waits for the next heavy reply's, up to
// notifyBatch replies per signal, as long as the first reply held was
// pushed less than holdFor ago. A stream of large requests then costs the
// guest one interrupt (and the server one eventfd write and, on a busy
// machine, one preemption by the woken guest thread) per several replies
// instead of one each: on 2 CPUs, 1 MiB reads and writes through one ring
// moved 3-12 % faster than with a signal per two replies, and their
// latency did not grow (direct front end, same runs). The guest, which
// hears of a held reply late by at most holdFor and one request's service
// time, still has as many requests queued as the server holds replies,
// and holdBehind more, so the daemon never waits for it meanwhile. As that
// queue drains, or before a cheap or slow request, every reply is
// signalled at once; when each request takes longer than holdFor (a slow
// disk), a reply waits for one more at most.
const holdBehind = 2

// holdFor bounds how long a heavy reply is held (holdBehind): long enough
// for several 1 MiB copies, short beside a disk's service time. A variable
// for tests.
var holdFor = 500 * time.Microsecond

// holds reports whether s may push heavy request cur's reply without a
// signal (holdBehind).
func (s *server) holds(cur *slot) bool {
	if s.held >= notifyBatch-1 || int(cur.behind) < holdBehind+s.held {
		return false
	}
	return s.held == 0 || monoNow()-s.heldAt < int64(holdFor)
}

// deferSlots is how many heavy writes a ring may hold back for the server
// already writing their file, beyond one slot per server.
const deferSlots = 8

// workers is how many servers the ring may have beyond its first. The hiprio
// ring (0) carries only FORGET and INTERRUPT, never worth a second core.
func (r *vring) workers() int {
	if r.index == 0 {
		return 0
	}
	return r.b.cfg.Workers
}

// ringSlots is the number of slots a ring with the given worker cap needs.
func ringSlots(workers int) int {
	if workers == 0 {
		return 1
	}
	return 1 + workers + deferSlots
}

func (r *vring) newSlots(n int) []*slot {
	slots := make([]*slot, n)
	for i := range slots {
		h := r.b.cfg.Handler.QueueHandler(r.index)
		c, _ := h.(Classifier)
		slots[i] = &slot{chain: virtqueue.NewDescChain(r.num), handler: h, classify: c}
	}
	return slots
}

// putMem drops the table reference *m holds, if any.
func putMem(m **virtqueue.GuestMemory) {
	if *m != nil {
		(*m).Put()
		*m = nil
	}
}

// release drops the chain's segments and the slot's own memory reference.
func (s *slot) release() {
	s.chain.Release()
	putMem(&s.mem)
}

// runner serves one started, enabled ring with up to 1 + Config.Workers
// server goroutines. There is no dispatcher: each server pops the next
// chain itself (under the ring's own lock), serves it, pushes the reply and
// pops again, so a busy ring costs no hand-off per request. The first
// server always runs; it wakes another only after popping a heavy request
// while more chains wait or no one watches the ring, and only while the
// back end's worker budget, shared by all rings, allows. A server with
// nothing to do either watches the kick fd (one at a time) or parks.
type runner struct {
	r        *vring
	q        *virtqueue.Queue
	kick     *kickWatch // nil: the ring is polled (kick sent with NOFD)
	stopping atomic.Bool
	stats    *ringStats // nil with metrics off
	done     chan struct{}

	// mu guards the Queue's consumer side (Snapshot, PopSeen,
	// EnableNotify) and the fields below. It is this ring's alone.
	mu      sync.Mutex
	servers []*server
	idle    []*server // parked servers, most recently parked last
	free    []*slot
	want    int  // slots the ring may use (ringSlots); r.slots grows to it on first need
	polling bool // a server waits for a kick
	// backoff and skip damp futile wake-ups: when a server woken for a
	// heavy request parks again having served nothing (every chain it
	// popped was a write to a file another server was writing), the next
	// backoff heavy requests wake no one; backoff doubles on each futile
	// wake-up and resets on a useful one.
	backoff int
	skip    int
	// heavyAt is when a server of this ring last popped a heavy request
	// while other rings ran (monoNow); streamAt, read by other rings'
	// servers, the last such time that followed the one before within
	// streamWindow (othersStreaming).
	heavyAt  int64
	streamAt atomic.Int64
	live     int                    // server goroutines started and not yet exited
	awake    int                    // servers started and neither parked nor exited
	extras   int                    // worker budget units held: at most awake-1
	lent     int                    // slots deferred to another ring's server and not yet given back
	ended    bool                   // done is closed
	fillers  *[fillersSize]filler   // nil with one server: who filled which buffer last
	mem      *virtqueue.GuestMemory // table for the chains the last Snapshot saw (referenced)
}

// server is one goroutine serving a ring.
type server struct {
	rn      *runner
	wake    chan struct{}
	started bool
	woken   bool                   // woken for a heavy request (spreadLocked)
	served  bool                   // served a request since it was last woken
	serving bool                   // counted in Backend.serving: holds a request, not asleep
	mem     *virtqueue.GuestMemory // reference covering the chains this server pops
	// unsignalled counts this ring's replies the server pushed since the
	// guest was last considered for a signal (notifyBatch).
	unsignalled int
	// ownTurn: the last request served was another ring's write, deferred
	// to s; this ring's chains come first next, so a ring that keeps
	// deferring cannot starve the one whose server it borrows.
	ownTurn bool
	// held counts the heavy replies of this ring pushed without a
	// signal; the next signal of the ring covers them (holdBehind).
	// heldAt is when the first of them was pushed (monoNow).
	held   int
	heldAt int64
	// first: the ring's first server, kept to the ring's share of the
	// CPUs while it serves small requests; placed: the plan its thread
	// follows now; loose, cheap: it served a large request since, and
	// how many small ones in a row (affinity.go).
	first  bool
	placed *cpuPlan
	loose  bool
	cheap  int

	// handoff is a heavy read of this ring that another of its servers
	// popped and left to s, which filled its buffer last (handOffLocked).
	// Guarded by the ring's mu.
	handoff *slot

	// deferMu guards node and backlog. Servers of every ring defer writes
	// here, each holding its own ring's mu, so it is a leaf: no other lock
	// is taken under it.
	deferMu sync.Mutex
	node    uint64  // node of the heavy WRITE being served; 0 for none
	backlog []*slot // writes to node deferred to this server, oldest first
}

// pollInterval is how often a ring without a kick fd is polled.
const pollInterval = 200 * time.Microsecond

func startRunner(r *vring, q *virtqueue.Queue, kickFD int, slots []*slot) *runner {
	rn := &runner{r: r, q: q, done: make(chan struct{}), stats: r.b.ringStats(r.index),
		want: ringSlots(r.workers())}
	rn.free = make([]*slot, 0, rn.want)
	rn.free = append(rn.free, slots...)
	if rn.stats != nil {
		rn.stats.active.Store(true)
	}
	n := 1 + r.workers()
	rn.servers = make([]*server, n)
	rn.idle = make([]*server, 0, n)
	for i := range rn.servers {
		// Any ring may defer writes to any server: room for them all,
		// so deferring never allocates.
		rn.servers[i] = &server{rn: rn, wake: make(chan struct{}, 1),
			backlog: make([]*slot, 0, rn.want*r.b.cfg.RequestQueues)}
	}
	// Servers are started on first need; the idle list hands out the
	// never-started ones last.
	for i := n - 1; i >= 1; i-- {
		rn.idle = append(rn.idle, rn.servers[i])
	}
	if kickFD >= 0 {
		k, err := newKickWatch(kickFD)
		if err != nil {
			r.log().Warn("cannot watch kick fd; polling the ring", "err", err)
		}
		rn.kick = k
	}
	if n > 1 {
		rn.fillers = new([fillersSize]filler)
	}
	rn.servers[0].first = true // the one kept to the ring's CPUs (affinity.go)
	rn.mu.Lock()
	rn.startLocked(rn.servers[0])
	rn.mu.Unlock()
	return rn
}

// stop asks the servers to finish and waits until every one has exited and
// every chain deferred to another ring's server has come back: every chain
// popped has then been completed and pushed, so the Queue's LastAvail is
// exact.
func (rn *runner) stop() {
	// A request waiting for the VMM (FS_IO) would wait forever: the VMM
	// answers only after we answer the message that stops this ring.
	b := rn.r.b
	b.backend.abort()
	defer b.backend.endAbort()
	rn.mu.Lock()
	rn.endLocked()
	rn.mu.Unlock()
	<-rn.done
	if err := rn.q.Notify(); err != nil {
		rn.r.log().Warn("notify guest", "err", err)
	}
	putMem(&rn.mem)
	if rn.kick != nil {
		rn.kick.close()
	}
}

// endLocked makes every server finish what it holds and exit.
func (rn *runner) endLocked() {
	rn.stopping.Store(true)
	if rn.kick != nil {
		rn.kick.interrupt()
	}
	for _, s := range rn.idle {
		if s.started {
			rn.awake++ // it wakes to exit
			s.wake <- struct{}{}
		}
	}
	rn.idle = rn.idle[:0]
}

// startLocked runs server s, on its goroutine's first use.
func (rn *runner) startLocked(s *server) {
	s.started = true
	rn.live++
	rn.awake++
	go s.run()
}

// wakeLocked takes the most recently parked server off the idle list and
// sets it running.
func (rn *runner) wakeLocked() *server {
	s := rn.idle[len(rn.idle)-1]
	rn.idle = rn.idle[:len(rn.idle)-1]
	if !s.started {
		rn.startLocked(s)
	} else {
		rn.awake++
		s.wake <- struct{}{} // buffered: a parked server reads it once
	}
	return s
}

// streamWindow is how close together a ring's heavy requests must come,
// and how recently, for it to count as streaming (othersStreaming). A
// variable for tests, which widen it against scheduling delays.
var streamWindow = 5 * time.Millisecond

// epoch anchors monoNow.
var epoch = time.Now()

// monoNow is the monotonic clock in nanoseconds.
func monoNow() int64 { return int64(time.Since(epoch)) }

// othersStreaming is called with mu held after rn popped a heavy request:
// it notes the time and reports whether another running ring streams
// heavy requests: popped two within streamWindow of each other, the last
// within streamWindow of now. Such a ring's server is busy, or briefly
// idle only because the guest has not yet queued its next requests: on a
// machine with few CPUs that is often because the guest's vCPUs are
// waiting for a CPU, and a second server woken then would take it from
// them (on 2 CPUs, 1 MiB reads through 2 busy rings were 10 % faster with
// no extra server than with one woken whenever a ring's server slept). A
// ring carrying small requests, or a large one now and then, does not
// count: it leaves most of a CPU free.
func (rn *runner) othersStreaming() bool {
	p := rn.r.b.plan.Load()
	if p == nil || len(p.runners) < 2 {
		return false
	}
	now := monoNow()
	if now-rn.heavyAt < int64(streamWindow) {
		rn.streamAt.Store(now)
	}
	rn.heavyAt = now
	for _, o := range p.runners {
		if o != rn && now-o.streamAt.Load() < int64(streamWindow) {
			return true
		}
	}
	return false
}

// spreadLocked is the per-request choice: after a heavy request is popped,
// wake another server if one is parked, a slot is free, either more chains
// wait or no one would watch the ring while this request is served, no
// other ring streams large requests, fewer servers serve (all rings) than
// Config.CPUs, and the worker budget allows.
func (rn *runner) spreadLocked() {
	streaming := rn.othersStreaming() // first: it notes this ring's pop
	if len(rn.free) == 0 {
		rn.growLocked()
	}
	if len(rn.idle) == 0 || len(rn.free) == 0 || rn.stopping.Load() {
		return
	}
	if rn.polling && !rn.q.Pending() {
		return
	}
	if rn.skip > 0 {
		rn.skip--
		return
	}
	if streaming {
		return
	}
	if b := rn.r.b; b.serving.Load() >= int32(b.cfg.CPUs) || !b.takeWorker() {
		return
	}
	rn.extras++
	rn.wakeLocked().woken = true
}

// growLocked allocates the ring's remaining slots, the first time a second
// server could use them: once per ring and queue size, not per request.
func (rn *runner) growLocked() {
	r := rn.r
	if n := rn.want - len(r.slots); n > 0 && len(rn.idle) > 0 && !rn.stopping.Load() {
		more := r.newSlots(n)
		r.slots = append(r.slots, more...) // the message loop reads it only after stop
		rn.free = append(rn.free, more...)
	}
}

// onFault turns a fault on guest memory (the front end shrank the file
// behind a mapping: SIGBUS) into a logged error instead of a dead daemon.
// Other panics are real bugs and go on.
func (rn *runner) onFault(e any) {
	fault, ok := e.(interface{ Addr() uintptr })
	if !ok {
		panic(e)
	}
	rn.r.log().Error("fault on guest memory; ring stopped", "addr", fmt.Sprintf("%#x", fault.Addr()))
}

func (s *server) run() {
	rn := s.rn
	// A server keeps its thread while it serves: a busy ring's server
	// then never sleeps, so Linux leaves its thread on one CPU, and a
	// woken front-end thread is placed on another instead of preempting
	// it on every notification (a switch, and on some hypervisors a TLB
	// flush, that made the copy to the file a third slower). Waiting for
	// a kick it sleeps in the kernel on that thread (kickWatch). Parked,
	// it lets go of the thread (parkLocked): a locked goroutine resumes
	// only after the thread that readied it hands it over to its own,
	// two thread wake-ups instead of one.
	runtime.LockOSThread()
	s.place()
	debug.SetPanicOnFault(true)
	var cur *slot
	defer func() {
		e := recover()
		if e != nil {
			// The chains this server holds are lost with the rings
			// they came from: guest memory faulted, and the other
			// rings map the same memory.
			rn.onFault(e)
			lost := s.dropDeferred()
			if cur != nil {
				lost = append(lost, cur)
			}
			rn.mu.Lock()
			rn.endLocked() // the ring stops; no more hand-offs to s
			if s.handoff != nil {
				lost = append(lost, s.handoff)
				s.handoff = nil
			}
			rn.mu.Unlock()
			for _, sl := range lost {
				sl.release()
				sl.rn.giveBack(sl, sl.rn != rn, true)
			}
		}
		rn.mu.Lock()
		s.leaveLocked()
		rn.live--
		rn.endedLocked()
		rn.mu.Unlock()
	}()
	for {
		done := cur
		cur = nil // a fault inside next must not free done twice
		cur = s.next(done)
		if cur == nil {
			return
		}
		s.follow(cur.heavy)
		written := cur.handler.Serve(cur.chain.Readable, cur.chain.Writable)
		// During a migration the reply's pages are logged before the
		// used index publishes it.
		cur.rn.q.LogWritten(cur.chain, written)
		// A cheap reply is signalled with its batch (next, notifyBatch),
		// a heavy one with the next unless the guest's queue runs low or
		// the first reply held has waited long enough (holdBehind), a
		// slow one at once. A write deferred from another ring, the only
		// chain of another ring a server serves and always urgent, goes
		// back to its own.
		from := cur.rn
		switch {
		case !cur.urgent:
			rn.q.Push(cur.chain.Head, written)
			s.unsignalled++
		case from == rn && cur.heavy && s.holds(cur):
			rn.q.Push(cur.chain.Head, written)
			s.unsignalled++
			if s.held == 0 {
				s.heldAt = monoNow()
			}
			s.held++
		default:
			if err := from.q.PushNotify(cur.chain.Head, written); err != nil {
				from.r.log().Warn("notify guest", "err", err)
			}
			if from == rn {
				s.unsignalled = 0 // the decision covered them
				s.held = 0
			}
		}
		from.completed()
		cur.release()
	}
}

// endedLocked closes done once no server runs and no slot is out with
// another ring's server.
func (rn *runner) endedLocked() {
	if rn.live > 0 || rn.lent > 0 || rn.ended {
		return
	}
	rn.ended = true
	if rn.stats != nil {
		rn.stats.active.Store(false)
	}
	close(rn.done)
}

// giveBack returns sl, popped by this runner, to its free list: lent says
// another ring's server held it. end stops the ring (a fault lost the
// chain).
func (rn *runner) giveBack(sl *slot, lent, end bool) {
	rn.mu.Lock()
	defer rn.mu.Unlock()
	rn.free = append(rn.free, sl)
	if end {
		rn.endLocked()
	}
	if !lent {
		return
	}
	rn.lent--
	if rn.awake == 0 && len(rn.idle) > 0 && !rn.stopping.Load() {
		// Every server parked, one of them for want of this slot
		// (popNoSlot): none watches the ring.
		rn.wakeLocked()
	}
	rn.endedLocked()
}

// leaveLocked drops what a server holds while it does not serve: its memory
// reference and, if the ring is left with fewer servers awake than budget
// units held, a unit of the worker budget. Units belong to the ring, not to
// a server: the first server woken may be the one that stays awake.
func (s *server) leaveLocked() {
	rn := s.rn
	s.setServing(false)
	putMem(&s.mem)
	rn.awake--
	for rn.extras > max(rn.awake-1, 0) {
		rn.r.b.putWorker()
		rn.extras--
	}
}

// next returns the slot done (served, or nil) to its ring's free list and
// returns the next request to serve: the oldest write deferred to this
// server, else a chain popped from the ring. It waits while there is
// nothing to serve and returns nil when the server must exit.
//
// A server keeps its claim on the node it last wrote (claimLocked) until it
// is about to serve something else or stop serving, so the next write to
// that node, popped here or on another ring, is deferred to it.
func (s *server) next(done *slot) *slot {
	rn := s.rn
	s.place()
	if done != nil && done.rn != rn {
		done.rn.giveBack(done, true, false) // before taking mu: one ring's lock at a time
		done = nil
	}
	rn.mu.Lock()
	defer rn.mu.Unlock()
	if done != nil {
		rn.free = append(rn.free, done)
	}
	if s.unsignalled >= notifyBatch || s.unsignalled > 0 && rn.q.SeenAvail() == rn.q.LastAvail() {
		s.signal()
	}
	for {
		if sl := s.handoff; sl != nil {
			s.handoff = nil
			s.served = true
			s.setServing(true)
			return sl
		}
		if !s.ownTurn {
			if sl := s.takeDeferred(); sl != nil {
				if s.ownTurn = sl.rn != rn; s.ownTurn {
					s.signal() // its reply goes to the other ring
				}
				s.served = true
				s.setServing(true)
				return sl
			}
		}
		s.ownTurn = false
		if rn.stopping.Load() {
			if !s.unclaim() {
				continue
			}
			s.signal()
			return nil
		}
		if rn.awake > 1 && rn.r.b.overCPUs() {
			// Rings that became busy since this server was woken
			// already fill the CPUs; another server of this ring is
			// awake to go on.
			if !s.unclaim() {
				continue
			}
			s.parkLocked()
			continue
		}
		sl, st := rn.popLocked(s)
		switch st {
		case popped:
			var heavy, slow bool
			var node uint64
			if sl.classify != nil {
				heavy, node, slow = sl.classify.Classify(sl.chain.Readable)
			}
			sl.heavy = heavy
			sl.behind = rn.q.SeenAvail() - rn.q.LastAvail()
			sl.urgent = heavy || slow
			switch {
			case s.held > 0 && heavy && !slow:
				// The held replies are signalled with this one's,
				// or held with it (holdBehind); if it is handed off
				// (handOffLocked), with the next one s serves.
			case sl.urgent || s.held > 0:
				// Replies already pushed must not wait for an urgent
				// request, nor held ones for anything but the next
				// heavy request (holdBehind).
				s.signal()
			}
			if node == 0 || node != s.node {
				if s.unclaim() && node != 0 && s.claimLocked(sl, node) {
					if s.held > 0 {
						s.signal() // they were to ride with sl's reply
					}
					continue // deferred to the server writing node
				}
			}
			if heavy && node == 0 && !slow && s.handOffLocked(sl) {
				continue // its buffer's filler serves it next
			}
			s.setServing(true) // before spreadLocked counts the servers serving
			if heavy {
				rn.spreadLocked()
			}
			s.served = true
			return sl
		case popBad:
			continue
		case popEnded:
			rn.endLocked()
			continue
		case popEmpty, popNoMemory:
			if !s.unclaim() {
				continue
			}
			if !rn.polling {
				s.watchLocked(st == popNoMemory)
				continue
			}
		}
		// Nothing this server can take: another watches the ring, or every
		// slot is held by a server that will come back for more (or give
		// it back: giveBack).
		if !s.unclaim() {
			continue
		}
		s.parkLocked()
	}
}

// signal signals the guest if it asked for the replies pushed so far, by
// any server of the ring, and s has pushed some since it last looked.
func (s *server) signal() {
	if s.unsignalled == 0 {
		return
	}
	s.unsignalled = 0
	s.held = 0
	s.notify()
}

// notify signals the guest if it asked for the replies pushed so far.
func (s *server) notify() {
	if err := s.rn.q.Notify(); err != nil {
		s.rn.r.log().Warn("notify guest", "err", err)
	}
}

// setServing moves s into or out of the back end's count of servers
// holding a request, which bounds the extra servers woken (Config.CPUs).
// It costs an atomic add only when a server starts or stops serving, not
// per request.
func (s *server) setServing(on bool) {
	if s.serving == on || s.rn.r.index == 0 {
		return // the hiprio ring's FORGETs are too brief to count
	}
	s.serving = on
	if on {
		s.rn.r.b.serving.Add(1)
	} else {
		s.rn.r.b.serving.Add(-1)
	}
}

// Two large writes to one file only contend for the host inode's lock, on
// whichever rings they arrive: the second is deferred to the server already
// writing that file, which serves it next (ordering between requests in
// flight is the guest's business, as with any two it has not waited for).
// A server writing a node claims it in the back end's writers table, so a
// server of any ring finds it without a lock shared by the rings.
//
// writersSize is the table's size. A node whose entry another node took
// is only not deferred: its writes contend, as they would without the
// table.
const writersSize = 256

// writersIndex hashes node to its writers table entry.
func writersIndex(node uint64) uint64 { return node * 0x9e3779b97f4a7c15 >> 56 }

// claimLocked is called with sl, a heavy write to node that s popped and
// holds no claim for. If a server of any ring is writing node, sl is
// deferred to it and claimLocked reports true. Otherwise s claims node,
// unless the table entry is another node's, and serves sl itself.
//
// The claim is exact: s's node is set before it enters the table, and a
// writer's node is cleared before it leaves, both under its deferMu, so a
// deferrer that finds a writer in the table sees either its claim on node
// or none. Only entries of other nodes (hash collisions) and writers of a
// stopping ring let two writes to one node run side by side.
func (s *server) claimLocked(sl *slot, node uint64) bool {
	rn := s.rn
	e := &rn.r.b.writers[writersIndex(node)]
	for {
		w := e.Load()
		if w != nil && w != s {
			lend := w.rn != rn
			w.deferMu.Lock()
			if w.node == node && (!lend || !w.rn.stopping.Load()) {
				sl.mem = s.mem
				sl.mem.TryGet() // cannot fail: s holds a reference
				w.backlog = append(w.backlog, sl)
				w.deferMu.Unlock()
				if lend {
					// Stop waits for it; this ring goes on popping
					// with its other slots (giveBack wakes a server
					// that ran out).
					rn.lent++
					if len(rn.free) == 0 {
						rn.growLocked()
					}
				}
				return true
			}
			taken := w.node != 0
			w.deferMu.Unlock()
			if taken {
				return false
			}
		}
		s.deferMu.Lock()
		s.node = node
		s.deferMu.Unlock()
		if e.CompareAndSwap(w, s) {
			return false
		}
		// Another server claimed the entry first: look again. A
		// deferrer holding a stale pointer to s may have seen the
		// claim meanwhile; what it deferred keeps s's claim.
		s.deferMu.Lock()
		if len(s.backlog) == 0 {
			s.node = 0
		}
		kept := s.node != 0
		s.deferMu.Unlock()
		if kept {
			return false
		}
	}
}

// unclaim gives up s's claim on the node it was writing unless a write to
// it was deferred to s meanwhile: it reports whether s holds no claim, and
// so has nothing deferred, now. Only s sets its node: it reads it unlocked.
func (s *server) unclaim() bool {
	if s.node == 0 {
		return true // a backlog is never left without its claim
	}
	s.deferMu.Lock()
	if len(s.backlog) > 0 {
		s.deferMu.Unlock()
		return false
	}
	node := s.node
	s.node = 0
	s.deferMu.Unlock()
	s.rn.r.b.writers[writersIndex(node)].CompareAndSwap(s, nil)
	return true
}

// takeDeferred returns the oldest write deferred to s, or nil.
func (s *server) takeDeferred() *slot {
	if s.node == 0 {
		return nil
	}
	s.deferMu.Lock()
	defer s.deferMu.Unlock()
	if len(s.backlog) == 0 {
		return nil
	}
	sl := s.backlog[0]
	n := copy(s.backlog, s.backlog[1:])
	s.backlog = s.backlog[:n]
	return sl
}

// dropDeferred gives up s's claim and returns the writes deferred to it.
func (s *server) dropDeferred() []*slot {
	s.deferMu.Lock()
	lost := append([]*slot(nil), s.backlog...)
	s.backlog = s.backlog[:0]
	node := s.node
	s.node = 0
	s.deferMu.Unlock()
	if node != 0 {
		s.rn.r.b.writers[writersIndex(node)].CompareAndSwap(s, nil)
	}
	return lost
}

// A heavy read copies up to a megabyte into the guest's buffer, and the
// copy costs more when the buffer's cache lines were last written from
// another CPU: on 2 CPUs, a ring's two servers took 151-160 µs per 1 MiB
// read into a buffer the other server had filled last and 111-114 µs into
// one they had filled themselves (tmpfs, direct front end, about half of
// each). A guest reuses its buffers (fio's, at any depth), so a ring with
// more than one server remembers who filled which buffer last, by the
// guest address of the chain's last writable segment, and a server that
// pops a heavy read whose buffer another server filled leaves it to that
// one (handOffLocked) when it is busy and has none waiting. 1 MiB reads
// through one ring moved 12 % (1 file) and 3 % (4 files) faster, 5 rounds;
// a prototype with a 1024-entry table, 9-10 %, every one of 7 paired
// rounds faster. At most one read waits per server, and only while the
// popping server has more chains to take, so no server idles while another
// has two reads to do.

// fillersBits sizes a ring's table of buffers and their last fillers: a
// few times the depth a guest keeps in flight on one ring. A buffer whose
// entry another took is only not handed off.
const (
	fillersBits = 8
	fillersSize = 1 << fillersBits
)

// filler is who filled a buffer last.
type filler struct {
	gpa uint64 // of the chain's last writable segment
	s   *server
}

// handOffLocked is called with sl, a heavy read s popped. If another server
// of the ring filled sl's buffer last, is serving and has no read waiting,
// and more chains wait for s, sl waits for that server (handoff) and
// handOffLocked reports true. Otherwise s serves sl and becomes its
// buffer's filler.
func (s *server) handOffLocked(sl *slot) bool {
	rn := s.rn
	segs := sl.chain.Writable.Segments()
	if rn.fillers == nil || len(segs) == 0 {
		return false
	}
	gpa := segs[len(segs)-1].GPA
	f := &rn.fillers[(gpa>>12)*0x9e3779b97f4a7c15>>(64-fillersBits)]
	if f.gpa != gpa {
		f.gpa, f.s = gpa, s
		return false
	}
	if o := f.s; o != s && o.serving && o.handoff == nil &&
		rn.q.SeenAvail() != rn.q.LastAvail() && !rn.stopping.Load() {
		sl.mem = s.mem
		sl.mem.TryGet() // cannot fail: s holds a reference
		o.handoff = sl
		return true
	}
	f.s = s
	return false
}

// maxBackoff bounds how many heavy requests pass without a wake-up after
// futile ones, so a ring whose traffic changes (one file, then many) gets
// its second server back within a few dozen requests.
const maxBackoff = 63

// parkLocked sleeps until another server (or stop) wakes s. mu is released
// meanwhile.
func (s *server) parkLocked() {
	rn := s.rn
	if s.woken {
		if s.served {
			rn.backoff = 0
		} else {
			rn.backoff = min(2*rn.backoff+1, maxBackoff)
			rn.skip = rn.backoff
		}
	}
	s.served, s.woken = false, false
	s.leaveLocked()
	rn.idle = append(rn.idle, s)
	rn.mu.Unlock()
	s.signal()
	s.unplace()
	runtime.UnlockOSThread() // see run
	<-s.wake
	runtime.LockOSThread()
	s.place()
	rn.mu.Lock()
}

// watchLocked waits for the guest to publish chains: it enables the guest's
// kicks, and unless chains arrived meanwhile, flushes notifications and
// sleeps on the kick fd. mu is released while it sleeps.
func (s *server) watchLocked(noMemory bool) {
	rn := s.rn
	if !noMemory && rn.q.EnableNotify() {
		return // raced with the guest: more chains arrived
	}
	// An idle ring must not pin a memory table the front end replaced
	// (an unplugged region would stay mapped): the next pop takes the
	// current one again.
	s.setServing(false)
	putMem(&s.mem)
	putMem(&rn.mem)
	rn.polling = true
	rn.mu.Unlock()
	s.unsignalled, s.held = 0, 0
	s.notify() // whatever any server pushed: the guest may sleep until it hears
	if rn.kick == nil {
		time.Sleep(pollInterval)
	} else {
		if err := rn.kick.wait(); err != nil {
			rn.r.log().Warn("watch ring", "err", err)
			rn.mu.Lock()
			rn.polling = false
			rn.endLocked()
			return
		}
	}
	s.place() // rings may have started or stopped meanwhile
	rn.mu.Lock()
	rn.polling = false
}

// popState is what popLocked found.
type popState int

const (
	popped      popState = iota // a chain to serve
	popBad                      // a malformed chain, already answered
	popEmpty                    // nothing published
	popNoMemory                 // chains wait, but no memory table is mapped
	popNoSlot                   // chains wait, but every slot is in use
	popEnded                    // the ring stopped serving
)

// popLocked takes the next chain into a free slot, translated with a table
// s holds a reference on.
func (rn *runner) popLocked(s *server) (*slot, popState) {
	q := rn.q
	if q.SeenAvail() == q.LastAvail() {
		// Read avail.idx before choosing the memory table: the chains
		// seen are translated with a table at least as new as the front
		// end's last acknowledged memory change.
		pending, err := q.Snapshot()
		if err != nil {
			rn.r.log().Error("ring stopped serving", "err", err)
			return nil, popEnded
		}
		if rn.stats != nil {
			rn.stats.seen.Store(uint32(q.SeenAvail()))
		}
		if !pending {
			return nil, popEmpty
		}
		if cur := rn.r.b.memory.Current(); cur != rn.mem {
			putMem(&rn.mem)
			rn.mem = rn.r.b.memory.Acquire()
		}
	}
	if rn.mem == nil {
		return nil, popNoMemory // memory withdrawn: nothing can be translated
	}
	if len(rn.free) == 0 {
		return nil, popNoSlot
	}
	if s.mem != rn.mem {
		putMem(&s.mem)
		rn.mem.TryGet() // cannot fail: the runner holds a reference
		s.mem = rn.mem
	}
	sl := rn.free[len(rn.free)-1]
	rn.free = rn.free[:len(rn.free)-1]
	ok, err := q.PopSeen(sl.chain, s.mem)
	if !ok {
		rn.free = append(rn.free, sl)
		if err != nil {
			rn.r.log().Error("ring stopped serving", "err", err)
			return nil, popEnded
		}
		return nil, popEmpty
	}
	if rn.stats != nil {
		rn.stats.popped.Add(1)
		rn.stats.taken.Store(uint32(q.LastAvail()))
	}
	switch {
	case err == nil:
		sl.rn = rn
		if q.AllowsUnmapped() {
			sl.chain.Readable.SetBouncer(&rn.r.b.backend)
			sl.chain.Writable.SetBouncer(&rn.r.b.backend)
		}
		return sl, popped
	case errors.Is(err, virtqueue.ErrBadChain):
		rn.bad(err)
		q.Push(sl.chain.Head, 0)
	default: // ErrBadHead: nothing to return
		rn.bad(err)
	}
	rn.completed()
	sl.release()
	rn.free = append(rn.free, sl)
	return nil, popBad
}

// completed counts a chain answered (or dropped, for a bad head).
func (rn *runner) completed() {
	if rn.stats != nil {
		rn.stats.completed.Add(1)
	}
}

// bad logs a malformed chain, rate-limited: the 1st, 2nd, 4th, 8th... so a
// hostile guest cannot flood the log.
func (rn *runner) bad(err error) {
	n := rn.r.badSeen.Add(1)
	if n&(n-1) == 0 {
		rn.r.log().Warn("malformed chain returned", "err", err, "count", n)
	}
}

// DefaultWorkers is the worker budget without --thread-pool-size: one fewer
// than the CPUs this process may run on (GOMAXPROCS, which also heeds a
// cgroup CPU limit, as Config.CPUs does; at least one), so a busy ring has
// one server per CPU. A server more than that only takes turns with the
// others: on 2 CPUs, 1+2 servers moved 1 MiB writes and reads 8-28 % slower
// than 1+1 (direct front end, tmpfs, same run).
func DefaultWorkers() int { return max(procsWithoutWatchers()-1, 1) }

// takeWorker claims one unit of the back end's worker budget, shared by
// all rings: one atomic add, no lock.
func (b *Backend) takeWorker() bool {
	if b.cfg.Workers <= 0 {
		return false
	}
	if b.busyWorkers.Add(1) > int32(b.cfg.Workers) {
		b.busyWorkers.Add(-1)
		return false
	}
	return true
}

func (b *Backend) putWorker() { b.busyWorkers.Add(-1) }

// overCPUs reports whether more servers serve than Config.CPUs.
func (b *Backend) overCPUs() bool { return b.serving.Load() > int32(b.cfg.CPUs) }
