package vhostuser

import (
	"encoding/binary"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/govirtiofsd/govirtiofsd/internal/bufvec"
	"github.com/govirtiofsd/govirtiofsd/test/vmm"
)

// probe is a request handler that records how requests overlap. A request
// is 40 readable bytes (the size of a fuse_in_header, which the front end
// insists on) starting with the node (0: not a write), a heavy flag, a slow
// flag (byte 9), a fault flag (byte 10: panic as a fault on guest memory
// would, once done), how long to take, in microseconds (bytes 12-15), and
// a tag (bytes 16-23; not 0: record who served it).
type probe struct {
	mu       sync.Mutex
	inflight map[uint64]int // heavy writes in service per node
	overlap  int            // heavy writes to one node served side by side
	busy     int            // requests in service
	maxBusy  int
	ringBusy [3]int // requests in service per ring (rings 0-2)
	ringMax  [3]int
	served   atomic.Int64
	handlers atomic.Int64 // QueueHandler calls: one per request slot allocated
	// cpus: the CPU set of the thread that served the last request of
	// each ring and kind (affinity_test.go).
	cpus map[probeKind]unix.CPUSet
	// tagged: who served each tagged request, and into which buffer.
	tagged map[uint64]servedBy
}

// servedBy is the server that served a request, as the goroutine it runs
// on (a parked server lets go of its thread), and the guest address of the
// request's last writable segment (the buffer a hand-off is keyed by).
type servedBy struct {
	server uint64
	gpa    uint64
}

// goroutineID returns the calling goroutine's ID, from the header of its
// stack trace ("goroutine 42 [running]:").
func goroutineID() uint64 {
	var b [32]byte
	n := runtime.Stack(b[:], false)
	f := strings.Fields(string(b[:n]))
	if len(f) < 2 {
		return 0
	}
	id, _ := strconv.ParseUint(f[1], 10, 64)
	return id
}

// servedTag returns who served the request tagged tag.
func (p *probe) servedTag(t *testing.T, tag uint64) servedBy {
	t.Helper()
	p.mu.Lock()
	defer p.mu.Unlock()
	by, ok := p.tagged[tag]
	if !ok {
		t.Fatalf("request %d was not served", tag)
	}
	return by
}

// probeFault is what a fault on guest memory panics with
// (debug.SetPanicOnFault), as far as the servers look at it.
type probeFault struct{}

func (probeFault) Error() string { return "probe: simulated fault on guest memory" }
func (probeFault) Addr() uintptr { return 0x1000 }

// seen returns the overlap counts (under the lock: the rings carry no
// happens-before the race detector can see).
func (p *probe) seen() (overlap, maxBusy int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.overlap, p.maxBusy
}

// waitServing waits until a request is in service.
func (p *probe) waitServing(t *testing.T, what string) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); ; {
		if _, maxBusy := p.seen(); maxBusy > 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s never started", what)
		}
		time.Sleep(100 * time.Microsecond)
	}
}

// reset forgets the overlap counts.
func (p *probe) reset() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.overlap, p.maxBusy = 0, 0
	p.ringMax = [3]int{}
}

// ringSeen returns the most requests ring had in service at once.
func (p *probe) ringSeen(ring int) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.ringMax[ring]
}

// probeKind is a ring and whether a request is heavy.
type probeKind struct {
	ring  int
	heavy bool
}

type probeQueue struct {
	p    *probe
	ring int
}

func (q probeQueue) read(in *bufvec.Vec) (r probeRequest, ok bool) {
	var b [24]byte
	err := in.ReadFull(b[:])
	in.Rewind()
	if err != nil {
		return r, false
	}
	return probeRequest{node: binary.LittleEndian.Uint64(b[0:]), heavy: b[8] != 0, slow: b[9] != 0,
		fault: b[10] != 0, d: time.Duration(binary.LittleEndian.Uint32(b[12:])) * time.Microsecond,
		tag: binary.LittleEndian.Uint64(b[16:])}, true
}

// probeRequest is a decoded probe request.
type probeRequest struct {
	node               uint64
	heavy, slow, fault bool
	d                  time.Duration
	tag                uint64
}

func (q probeQueue) Classify(in *bufvec.Vec) (bool, uint64, bool) {
	r, ok := q.read(in)
	if !ok || !r.heavy {
		return false, 0, r.slow
	}
	return true, r.node, r.slow
}

func (q probeQueue) Serve(in, out *bufvec.Vec) uint32 {
	r, ok := q.read(in)
	if !ok {
		return 0
	}
	node, heavy, d := r.node, r.heavy, r.d
	p := q.p
	var cpus unix.CPUSet
	cpusErr := unix.SchedGetaffinity(0, &cpus)
	p.mu.Lock()
	if cpusErr == nil {
		p.cpus[probeKind{q.ring, heavy}] = cpus
	}
	p.busy++
	p.maxBusy = max(p.maxBusy, p.busy)
	if q.ring < len(p.ringBusy) {
		p.ringBusy[q.ring]++
		p.ringMax[q.ring] = max(p.ringMax[q.ring], p.ringBusy[q.ring])
	}
	if heavy && node != 0 {
		p.inflight[node]++
		if p.inflight[node] > 1 {
			p.overlap++
		}
	}
	if segs := out.Segments(); r.tag != 0 && len(segs) > 0 {
		p.tagged[r.tag] = servedBy{goroutineID(), segs[len(segs)-1].GPA}
	}
	p.mu.Unlock()
	time.Sleep(d)
	p.mu.Lock()
	p.busy--
	if q.ring < len(p.ringBusy) {
		p.ringBusy[q.ring]--
	}
	if heavy && node != 0 {
		p.inflight[node]--
	}
	p.mu.Unlock()
	if r.fault {
		panic(probeFault{})
	}
	p.served.Add(1)
	var reply [16]byte
	if out.WriteFull(reply[:]) != nil {
		return 0
	}
	return uint32(len(reply))
}

// startProbe serves one connection with a probe handler and returns the
// front end, with ring 1 ready for requests.
func startProbe(t *testing.T, workers int) (*probe, *vmm.Device) {
	// CPUs fixed, so the test machine's count does not cap the servers.
	return startProbeRings(t, 1, workers, 8)
}

// startProbeRings is startProbe with rings request rings and the given
// Config.CPUs.
func startProbeRings(t *testing.T, rings, workers, cpus int) (*probe, *vmm.Device) {
	t.Helper()
	p := &probe{inflight: map[uint64]int{}, cpus: map[probeKind]unix.CPUSet{}, tagged: map[uint64]servedBy{}}
	b, err := NewBackend(Config{RequestQueues: rings, Tag: "probe", Workers: workers, CPUs: cpus,
		Logger:  slog.New(slog.NewTextHandler(io.Discard, nil)),
		Handler: HandlerFunc(func(ring int) RequestHandler { p.handlers.Add(1); return probeQueue{p, ring} })})
	if err != nil {
		t.Fatal(err)
	}
	opts := vmm.DefaultOptions()
	opts.Queues = 1 + rings
	return p, serveOne(t, b, func(sock string) (*vmm.Device, error) { return vmm.Start(sock, opts) })
}

// serveOne serves b on a fresh socket and connects a device to it with
// connect; at the test's end the device goes and b must stop serving.
func serveOne(t *testing.T, b *Backend, connect func(sock string) (*vmm.Device, error)) *vmm.Device {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "vhost.sock")
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: sock, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- b.ServeFirst(l) }()
	d, err := connect(sock)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		d.Close()
		select {
		case <-served:
		case <-time.After(10 * time.Second):
			t.Error("back end still serving 10 s after the front end left")
		}
	})
	return d
}

// submit publishes the requests on ring 1 in one batch and waits for all.
func submit(t *testing.T, d *vmm.Device, reqs [][40]byte) {
	t.Helper()
	submitOn(t, d, 1, reqs)
}

func submitOn(t *testing.T, d *vmm.Device, ring int, reqs [][40]byte) {
	t.Helper()
	q := d.Queue(ring)
	calls := make([]*vmm.FuseCall, len(reqs))
	for i := range reqs {
		fc, err := q.AddFuse(vmm.FuseRequest{In: reqs[i][:], OutArgs: 0})
		if err != nil {
			t.Fatal(err)
		}
		calls[i] = fc
	}
	if _, err := q.Notify(); err != nil {
		t.Fatal(err)
	}
	for i, fc := range calls {
		if _, err := fc.Wait(10 * time.Second); err != nil {
			t.Fatalf("request %d: %v", i, err)
		}
	}
}

// addOn publishes one request on ring and kicks, without waiting for it.
func addOn(t *testing.T, d *vmm.Device, ring int, r [40]byte) *vmm.FuseCall {
	t.Helper()
	q := d.Queue(ring)
	fc, err := q.AddFuse(vmm.FuseRequest{In: r[:], OutArgs: 0})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := q.Notify(); err != nil {
		t.Fatal(err)
	}
	return fc
}

func request(node uint64, heavy bool, d time.Duration) (r [40]byte) {
	binary.LittleEndian.PutUint64(r[0:], node)
	if heavy {
		r[8] = 1
	}
	binary.LittleEndian.PutUint32(r[12:], uint32(d/time.Microsecond))
	return r
}

// TestServersSerializeWritesToOneNode: heavy writes to one node are served
// one at a time however many servers the ring has, and all are served.
func TestServersSerializeWritesToOneNode(t *testing.T) {
	p, d := startProbe(t, 2)
	var reqs [][40]byte
	for range 48 {
		reqs = append(reqs, request(7, true, time.Millisecond))
	}
	submit(t, d, reqs)
	if overlap, _ := p.seen(); overlap != 0 {
		t.Errorf("%d heavy writes to one node overlapped another", overlap)
	}
	if n := p.served.Load(); n != int64(len(reqs)) {
		t.Errorf("served %d of %d", n, len(reqs))
	}
}

// TestServersSpreadHeavyRequests: heavy requests to different nodes are
// served side by side, never two to one node, batch after batch: between
// batches the ring runs dry, and whichever server is left watching it must
// still be able to wake another (the worker budget belongs to the ring, not
// to the server first woken with it).
func TestServersSpreadHeavyRequests(t *testing.T) {
	for _, workers := range []int{1, 2} {
		t.Run(fmt.Sprintf("workers=%d", workers), func(t *testing.T) {
			p, d := startProbe(t, workers)
			for batch := range 6 {
				p.reset()
				var reqs [][40]byte
				for i := range 16 {
					reqs = append(reqs, request(uint64(1+i%4), true, 2*time.Millisecond))
				}
				submit(t, d, reqs)
				overlap, maxBusy := p.seen()
				if overlap != 0 {
					t.Errorf("batch %d: %d heavy writes to one node overlapped another", batch, overlap)
				}
				if maxBusy < 2 {
					t.Errorf("batch %d: at most %d request(s) in service at once, want 2 or more", batch, maxBusy)
				}
				if maxBusy > 1+workers {
					t.Errorf("batch %d: %d requests in service at once on a ring with 1+%d servers", batch, maxBusy, workers)
				}
				time.Sleep(5 * time.Millisecond) // let the servers park
			}
			// Spreading grew ring 1 to all its slots, once.
			if n, want := p.handlers.Load(), int64(1+ringSlots(workers)); n != want {
				t.Errorf("%d request slots allocated, want %d", n, want)
			}
		})
	}
}

// TestServersCheapInline: cheap requests never wake a second server, and
// with no workers nothing runs side by side at all.
func TestServersCheapInline(t *testing.T) {
	for _, tc := range []struct {
		name    string
		workers int
		heavy   bool
	}{
		{"cheap", 2, false},
		{"no-workers", 0, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p, d := startProbe(t, tc.workers)
			var reqs [][40]byte
			for i := range 32 {
				reqs = append(reqs, request(uint64(1+i%4), tc.heavy, 500*time.Microsecond))
			}
			submit(t, d, reqs)
			if _, maxBusy := p.seen(); maxBusy != 1 {
				t.Errorf("%d requests in service at once, want 1", maxBusy)
			}
			// A ring served by one server allocates one slot (and the
			// hiprio ring one).
			if n := p.handlers.Load(); n != 2 {
				t.Errorf("%d request slots allocated, want 2", n)
			}
		})
	}
}

// TestServersBoundedByCPUs: while as many servers serve as there are CPUs
// (here ring 2's own server, busy with cheap requests, and ring 1's), a
// heavy request on ring 1 wakes no extra server: it would only take turns
// with the others on the CPUs. A ring's own server always serves, even
// beyond the CPUs.
func TestServersBoundedByCPUs(t *testing.T) {
	for _, tc := range []struct {
		cpus, wantMax int
	}{
		{2, 2},
		{1, 2},
		{3, 3}, // the control: room for an extra server
	} {
		t.Run(fmt.Sprintf("cpus=%d", tc.cpus), func(t *testing.T) {
			p, d := startProbeRings(t, 2, 2, tc.cpus)
			var busy [][40]byte
			for range 8 {
				busy = append(busy, request(0, false, 10*time.Millisecond))
			}
			done := make(chan struct{})
			go func() {
				defer close(done)
				submitOn(t, d, 2, busy)
			}()
			p.waitServing(t, "ring 2's requests")
			var heavy [][40]byte
			for i := range 16 {
				heavy = append(heavy, request(uint64(1+i%4), true, 2*time.Millisecond))
			}
			submitOn(t, d, 1, heavy)
			<-done
			if _, maxBusy := p.seen(); maxBusy != tc.wantMax {
				t.Errorf("%d requests in service at once, want %d", maxBusy, tc.wantMax)
			}
		})
	}
}

// TestStreamingRingKeepsOthersToOneServer: while ring 2 streams heavy
// requests, a batch of them on ring 1 wakes no extra server, though the
// CPUs and the worker budget would allow one (othersStreaming); with ring
// 2 idle, or carrying a heavy request only now and then, it does, even
// right after one of those.
func TestStreamingRingKeepsOthersToOneServer(t *testing.T) {
	// Wide enough that a test machine's scheduling delays do not end a
	// stream; ring 2's requests now and then come 3 windows apart.
	defer func(w time.Duration) { streamWindow = w }(streamWindow)
	streamWindow = 200 * time.Millisecond
	for _, tc := range []struct {
		name   string
		gap    time.Duration // between ring 2's heavy requests; 0: idle
		stream bool
	}{
		{"streaming", 0, true},
		{"idle", 0, false},
		{"now and then", 3 * streamWindow, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			// Workers to spare: ring 2 keeps at most 2 busy.
			p, d := startProbeRings(t, 2, 4, 8)
			stop := make(chan struct{})
			done := make(chan struct{})
			trickled := make(chan struct{}, 1000)
			go func() {
				defer close(done)
				for {
					select {
					case <-stop:
						return
					default:
					}
					switch {
					case tc.stream:
						submitOn(t, d, 2, [][40]byte{request(100, true, 500*time.Microsecond),
							request(101, true, 500*time.Microsecond)})
						trickled <- struct{}{}
					case tc.gap > 0:
						submitOn(t, d, 2, [][40]byte{request(100, true, 0)})
						trickled <- struct{}{}
						time.Sleep(tc.gap)
					default:
						return
					}
				}
			}()
			switch {
			case tc.stream:
				<-trickled // two popped: ring 2 streams
			case tc.gap > 0:
				<-trickled
				<-trickled // the batch goes out right after the second
			}
			// Two long requests: a second server, if the first pop wakes
			// one, serves the second beside the first.
			heavy := [][40]byte{request(1, true, 20*time.Millisecond), request(2, true, 20*time.Millisecond)}
			submitOn(t, d, 1, heavy)
			close(stop)
			<-done
			got := p.ringSeen(1)
			if tc.stream && got != 1 {
				t.Errorf("ring 1 served %d requests at once beside a streaming ring, want 1", got)
			}
			if !tc.stream && got != 2 {
				t.Errorf("ring 1 served %d requests at once, want 2", got)
			}
		})
	}
}

// TestServersSerializeWritesAcrossRings: heavy writes to one node arriving
// on two rings at once are served one at a time (each ring defers to the
// server already writing the node, whichever ring it serves), with and
// without workers, and every one is answered on its own ring.
func TestServersSerializeWritesAcrossRings(t *testing.T) {
	for _, workers := range []int{0, 1} {
		t.Run(fmt.Sprintf("workers=%d", workers), func(t *testing.T) {
			p, d := startProbeRings(t, 2, workers, 8)
			var reqs [][40]byte
			for range 24 {
				reqs = append(reqs, request(7, true, time.Millisecond))
			}
			var wg sync.WaitGroup
			for ring := 1; ring <= 2; ring++ {
				wg.Add(1)
				go func() {
					defer wg.Done()
					submitOn(t, d, ring, reqs)
				}()
			}
			wg.Wait()
			if overlap, _ := p.seen(); overlap != 0 {
				t.Errorf("%d heavy writes to one node overlapped another", overlap)
			}
			if n := p.served.Load(); n != 2*int64(len(reqs)) {
				t.Errorf("served %d of %d", n, 2*len(reqs))
			}
			for ring := 1; ring <= 2; ring++ {
				if u := d.Queue(ring).UsedIdx(); u != uint16(len(reqs)) {
					t.Errorf("ring %d: used index %d, want %d", ring, u, len(reqs))
				}
			}
		})
	}
}

// TestStopWaitsForLentWrite: a write deferred to another ring's server is
// still the stopped ring's chain: GET_VRING_BASE answers only once it has
// been served and pushed, so the base it returns is exact.
func TestStopWaitsForLentWrite(t *testing.T) {
	p, d := startProbeRings(t, 2, 1, 8)
	add := func(ring int, r [40]byte) *vmm.FuseCall { return addOn(t, d, ring, r) }
	first := add(1, request(7, true, 300*time.Millisecond))
	p.waitServing(t, "ring 1's write")
	lent := add(2, request(7, true, 50*time.Millisecond))
	time.Sleep(50 * time.Millisecond) // ring 2's server pops it and defers it to ring 1's
	base, err := d.StopQueue(2)
	if err != nil {
		t.Fatal(err)
	}
	if u := d.Queue(2).UsedIdx(); base != 1 || u != 1 {
		t.Errorf("ring 2 stopped at base %d with used index %d, want 1 and 1", base, u)
	}
	for _, fc := range []*vmm.FuseCall{first, lent} {
		if _, err := fc.Wait(10 * time.Second); err != nil {
			t.Fatal(err)
		}
	}
	if overlap, _ := p.seen(); overlap != 0 {
		t.Errorf("the write on ring 2 ran beside ring 1's write to the same node (%d overlaps)", overlap)
	}
}

// TestRepliesSignalledPerBatch: cheap replies are signalled once per batch
// of notifyBatch (or at the end of what the server saw), not once each;
// heavy replies, while more requests stay queued behind them, at least once
// per notifyBatch and more often as the queue drains (holdBehind: 7 for
// these 32), but a reply waits for one more at most when each request
// takes longer than holdFor; and no reply is left unsignalled (the front
// end collects replies only on interrupts, so a missing signal is a
// timeout in submit).
func TestRepliesSignalledPerBatch(t *testing.T) {
	for _, tc := range []struct {
		name     string
		heavy    bool
		service  time.Duration // per request
		holdFor  time.Duration
		min, max int // interrupts for 32 requests
	}{
		// A loaded machine only merges interrupts: the bounds below
		// are loose where that could move them. Each request is slow
		// enough that the front end's interrupt handler takes each
		// signal on its own.
		{"cheap", false, 300 * time.Microsecond, time.Second, 1, 32/notifyBatch + 2},
		{"heavy", true, 300 * time.Microsecond, time.Second, 32 / notifyBatch, 32/notifyBatch + 2*holdBehind + 2},
		// About 17: replies in pairs, and the last ones alone.
		{"heavy and slow", true, 600 * time.Microsecond, 100 * time.Microsecond, 12, 32},
	} {
		t.Run(tc.name, func(t *testing.T) {
			// Restored after the back end's servers exit (startProbe's
			// cleanup runs first).
			old := holdFor
			t.Cleanup(func() { holdFor = old })
			holdFor = tc.holdFor
			_, d := startProbe(t, 0)
			var reqs [][40]byte
			for i := range 32 {
				reqs = append(reqs, request(uint64(1+i%4), tc.heavy, tc.service))
			}
			before := d.Queue(1).Stats().Interrupts
			submit(t, d, reqs)
			n := d.Queue(1).Stats().Interrupts - before
			t.Logf("%d interrupts", n)
			if n < tc.min || n > tc.max {
				t.Errorf("%d interrupts for %d replies, want %d to %d", n, len(reqs), tc.min, tc.max)
			}
		})
	}
}

// TestRepliesSignalledBeforeSlow: replies pushed before a slow request (an
// fsync) are signalled before the server starts on it, not when its batch
// ends.
func TestRepliesSignalledBeforeSlow(t *testing.T) {
	_, d := startProbe(t, 0)
	q := d.Queue(1)
	var calls []*vmm.FuseCall
	for i := range 5 {
		r := request(0, false, 100*time.Microsecond)
		if i == 4 {
			r = request(0, false, time.Second)
			r[9] = 1 // slow
		}
		fc, err := q.AddFuse(vmm.FuseRequest{In: r[:], OutArgs: 0})
		if err != nil {
			t.Fatal(err)
		}
		calls = append(calls, fc)
	}
	if _, err := q.Notify(); err != nil {
		t.Fatal(err)
	}
	for i, fc := range calls[:4] {
		if _, err := fc.Wait(500 * time.Millisecond); err != nil {
			t.Fatalf("request %d, before the slow one: %v", i, err)
		}
	}
	if _, err := calls[4].Wait(10 * time.Second); err != nil {
		t.Fatal(err)
	}
}

// TestLentWritesDoNotStarveTheRing: a server writing a node that another
// ring keeps deferring writes to still serves its own ring in between, one
// of its own chains after each lent one, rather than only once the other
// ring runs dry.
func TestLentWritesDoNotStarveTheRing(t *testing.T) {
	for _, tc := range []struct{ workers, cpus int }{{0, 8}, {1, 1}, {1, 8}} {
		t.Run(fmt.Sprintf("workers=%d,cpus=%d", tc.workers, tc.cpus), func(t *testing.T) {
			testLentWritesDoNotStarve(t, tc.workers, tc.cpus)
		})
	}
}

func testLentWritesDoNotStarve(t *testing.T, workers, cpus int) {
	p, d := startProbeRings(t, 2, workers, cpus)
	add := func(ring int, r [40]byte) *vmm.FuseCall { return addOn(t, d, ring, r) }
	// Ring 1's server claims node 7.
	first := add(1, request(7, true, 100*time.Millisecond))
	p.waitServing(t, "ring 1's write")
	// Ring 2 defers a stream of writes to node 7 to it...
	var lent []*vmm.FuseCall
	for range 40 {
		lent = append(lent, add(2, request(7, true, 2*time.Millisecond)))
	}
	time.Sleep(5 * time.Millisecond) // ring 2's server pops and defers them
	// ...while ring 1 has a cheap request of its own.
	own := add(1, request(0, false, 0))
	if _, err := own.Wait(10 * time.Second); err != nil {
		t.Fatal(err)
	}
	var doneFirst int
	for _, fc := range lent {
		select {
		case <-fc.Chain.Done():
			doneFirst++
		default:
		}
	}
	for _, fc := range append(lent, first) {
		if _, err := fc.Wait(10 * time.Second); err != nil {
			t.Fatal(err)
		}
	}
	if doneFirst > 4 {
		t.Errorf("ring 1's own request waited for %d of ring 2's %d writes deferred to its server", doneFirst, len(lent))
	}
	if overlap, _ := p.seen(); overlap != 0 {
		t.Errorf("%d heavy writes to one node overlapped another", overlap)
	}
}

// readRequest is a heavy read of d tagged tag, which faults when done if
// fault is set.
func readRequest(tag uint64, d time.Duration, fault bool) (r [40]byte) {
	r = request(0, true, d)
	if fault {
		r[10] = 1
	}
	binary.LittleEndian.PutUint64(r[16:], tag)
	return r
}

// addPaged publishes reqs on ring 1, each with a page of reply data, and
// kicks once. The front end's first-fit allocator gives a batch laid out
// the same way as one already returned the same buffers, as a guest's
// driver reuses its pages.
func addPaged(t *testing.T, d *vmm.Device, reqs ...[40]byte) []*vmm.FuseCall {
	t.Helper()
	q := d.Queue(1)
	var calls []*vmm.FuseCall
	for _, r := range reqs {
		fc, err := q.AddFuse(vmm.FuseRequest{In: r[:], OutPages: vmm.PageSize})
		if err != nil {
			t.Fatal(err)
		}
		calls = append(calls, fc)
	}
	if _, err := q.Notify(); err != nil {
		t.Fatal(err)
	}
	return calls
}

func waitAll(t *testing.T, calls []*vmm.FuseCall) {
	t.Helper()
	for i, fc := range calls {
		if _, err := fc.Wait(10 * time.Second); err != nil {
			t.Fatalf("request %d: %v", i, err)
		}
	}
}

// handOffSetUp starts a back end whose ring 1 has two servers, serves a
// long read and a short one side by side on them, then publishes long,
// short and third: long and short in the buffers of the first two. It
// returns once the server that filled short's buffer is busy with long and
// third is served, so that short was popped by the other server while its
// buffer's filler was busy and a chain waited behind it. It returns the
// calls and who filled short's buffer the first time.
func handOffSetUp(t *testing.T, long, short, third [40]byte) (*probe, *vmm.Device, []*vmm.FuseCall, servedBy) {
	t.Helper()
	for attempt := 1; ; attempt++ {
		p, d := startProbe(t, 1) // two servers
		waitAll(t, addPaged(t, d, readRequest(1, 30*time.Millisecond, false), readRequest(2, time.Millisecond, false)))
		first, filler := p.servedTag(t, 1), p.servedTag(t, 2)
		if first.server == filler.server {
			t.Fatalf("one server (goroutine %d) served both reads: the ring never spread", first.server)
		}
		// Let the long read's server go idle: still popping, it would
		// take long as soon as it is published, alone.
		time.Sleep(10 * time.Millisecond)
		calls := addPaged(t, d, long, short, third)
		for deadline := time.Now().Add(5 * time.Second); p.served.Load() < 3; {
			if time.Now().After(deadline) {
				t.Fatal("the third read was not served within 5 s")
			}
			time.Sleep(100 * time.Microsecond)
		}
		if p.servedTag(t, binary.LittleEndian.Uint64(long[16:])).server == filler.server {
			return p, d, calls, filler
		}
		if attempt == 3 {
			t.Fatalf("in %d attempts, the server that filled the short read's buffer never took the long read first", attempt)
		}
		t.Logf("attempt %d: the long read went to the other server; again", attempt)
	}
}

// TestHeavyReadGoesToItsBuffersFiller: a server that pops a heavy read
// whose buffer another server of the ring filled last, while that server is
// busy and more chains wait, leaves the read to it (handOffLocked): the
// buffer's cache lines are still that server's CPU's.
func TestHeavyReadGoesToItsBuffersFiller(t *testing.T) {
	p, _, calls, filler := handOffSetUp(t,
		readRequest(3, 30*time.Millisecond, false), readRequest(4, time.Millisecond, false), readRequest(5, time.Millisecond, false))
	waitAll(t, calls)
	long, short := p.servedTag(t, 3), p.servedTag(t, 4)
	if short.gpa != filler.gpa {
		t.Fatalf("the front end put the second batch's short read at %#x, not in the first's buffer %#x", short.gpa, filler.gpa)
	}
	t.Logf("short read's buffer filled by goroutine %d; the long read served by %d, then the short one by %d", filler.server, long.server, short.server)
	if short.server != filler.server {
		t.Errorf("the short read went to goroutine %d, not to the one that filled its buffer (%d)", short.server, filler.server)
	}
}

// TestStopServesHandedOffRead: a read left to a busy server is still the
// ring's chain: GET_VRING_BASE answers once that server has served it, with
// every popped chain pushed.
func TestStopServesHandedOffRead(t *testing.T) {
	p, d, calls, filler := handOffSetUp(t,
		readRequest(3, 200*time.Millisecond, false), readRequest(4, time.Millisecond, false), readRequest(5, time.Millisecond, false))
	base, err := d.StopQueue(1)
	if err != nil {
		t.Fatal(err)
	}
	if u := d.Queue(1).UsedIdx(); base != 5 || u != 5 {
		t.Errorf("ring stopped at base %d with used index %d, want 5 and 5", base, u)
	}
	waitAll(t, calls)
	if short := p.servedTag(t, 4); short.server != filler.server {
		t.Errorf("the short read went to goroutine %d, not to the one that filled its buffer (%d)", short.server, filler.server)
	}
}

// TestFaultDropsHandedOffRead: when the server a read was left to faults on
// guest memory, the ring stops with both its chains unanswered, as with any
// chain a faulting server holds, and the daemon goes on: GET_VRING_BASE
// answers, the lost chains let go of the memory table they were translated
// with, and the ring, restarted, serves again.
func TestFaultDropsHandedOffRead(t *testing.T) {
	p, d, calls, _ := handOffSetUp(t,
		readRequest(3, 100*time.Millisecond, true), readRequest(4, time.Millisecond, false), readRequest(5, time.Millisecond, false))
	mapped := guestRAMMappings(t, d)
	if _, err := calls[2].Wait(5 * time.Second); err != nil {
		t.Fatal(err)
	}
	base, err := d.StopQueue(1)
	if err != nil {
		t.Fatal(err)
	}
	if u := d.Queue(1).UsedIdx(); base != 5 || u != 3 {
		t.Errorf("ring stopped at base %d with used index %d, want 5 and 3 (the faulting read and the one left to its server lost)", base, u)
	}
	p.mu.Lock()
	_, served := p.tagged[4]
	p.mu.Unlock()
	if served {
		t.Error("the read left to the faulting server was served")
	}
	// As a guest resets the device after such a stop: fresh rings, the
	// lost chains abandoned. A new table (SET_MEM_TABLE) meanwhile must be
	// the only one left mapped once the rings have moved to it.
	if _, err := d.Stop(); err != nil {
		t.Fatal(err)
	}
	if err := d.SendMemTable(); err != nil {
		t.Fatal(err)
	}
	if err := d.Restart(true); err != nil {
		t.Fatal(err)
	}
	if n := guestRAMMappings(t, d); n != mapped {
		t.Errorf("guest RAM mapped %d times after the table was replaced, was %d: a lost chain still holds the old table", n, mapped)
	}
	var reqs [][40]byte
	for range 16 {
		reqs = append(reqs, readRequest(0, 100*time.Microsecond, false))
	}
	submit(t, d, reqs)
}

// guestRAMMappings counts this process's mappings of the front end's guest
// RAM files: the front end's own and the back end's current table's.
func guestRAMMappings(t *testing.T, d *vmm.Device) int {
	t.Helper()
	inodes := map[string]bool{}
	for _, r := range d.Mem.Regions() {
		var st unix.Stat_t
		if err := unix.Fstat(r.Fd(), &st); err != nil {
			t.Fatal(err)
		}
		inodes[strconv.FormatUint(st.Ino, 10)] = true
	}
	maps, err := os.ReadFile("/proc/self/maps")
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, line := range strings.Split(string(maps), "\n") {
		// address perms offset dev inode path
		if f := strings.Fields(line); len(f) >= 6 && inodes[f[4]] && strings.Contains(f[5], "vmm-guest-ram") {
			n++
		}
	}
	return n
}
