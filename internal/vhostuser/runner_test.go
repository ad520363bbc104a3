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
	b        *Backend // the back end it serves
	mu       sync.Mutex
	inflight map[uint64]int // heavy writes in service per node
	overlap  int            // heavy writes to one node served side by side
	busy     int            // requests in service
	maxBusy  int
	ringBusy [3]int // requests in service per ring (rings 0-2)
	ringMax  [3]int
	served   atomic.Int64
	handlers atomic.Int64 // QueueHandler calls: one per request slot allocated
	// tagged: who served each tagged request, and into which buffer.
	tagged map[uint64]servedBy
}

// servedBy is the server that served a request, as the goroutine it runs
// on, and the guest address of the request's last writable segment.
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
	p.mu.Lock()
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
	return startProbeRings(t, 1, workers)
}

// startProbeRings is startProbe with rings request rings. The process has
// the daemon's Ps (reserveTestProcs).
func startProbeRings(t *testing.T, rings, workers int) (*probe, *vmm.Device) {
	return startProbeWatched(t, rings, workers, reserveTestProcs)
}

// startProbeWatched is startProbeRings with watched as Config.RingsWatched.
func startProbeWatched(t *testing.T, rings, workers int, watched func(int)) (*probe, *vmm.Device) {
	t.Helper()
	p := &probe{inflight: map[uint64]int{}, tagged: map[uint64]servedBy{}}
	b, err := NewBackend(Config{RequestQueues: rings, Tag: "probe", Workers: workers, RingsWatched: watched,
		Logger:  slog.New(slog.NewTextHandler(io.Discard, nil)),
		Handler: HandlerFunc(func(ring int) RequestHandler { p.handlers.Add(1); return probeQueue{p, ring} })})
	if err != nil {
		t.Fatal(err)
	}
	p.b = b
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

// TestServersSpreadHeavyRequests: heavy requests are served side by side,
// by at most 1+workers servers, batch after batch: between batches the ring
// runs dry, and whichever server is left watching it must still be able to
// wake another (the worker budget belongs to the ring, not to the server
// first woken with it). Each server makes its slot once.
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
				_, maxBusy := p.seen()
				if maxBusy < 2 {
					t.Errorf("batch %d: at most %d request(s) in service at once, want 2 or more", batch, maxBusy)
				}
				if maxBusy > 1+workers {
					t.Errorf("batch %d: %d requests in service at once on a ring with 1+%d servers", batch, maxBusy, workers)
				}
				time.Sleep(5 * time.Millisecond) // let the servers park
			}
			// One slot per server that ran, and the hiprio ring's.
			if n := p.handlers.Load(); n < 3 || n > int64(2+workers) {
				t.Errorf("%d request slots allocated, want 3 to %d", n, 2+workers)
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
			// A ring served by one server makes one slot (and the
			// hiprio ring one).
			if n := p.handlers.Load(); n != 2 {
				t.Errorf("%d request slots allocated, want 2", n)
			}
		})
	}
}

// TestWorkerBudgetSharedByRings: --thread-pool-size bounds the extra
// servers of all rings together: with a budget of 1, two rings busy with
// heavy requests have at most 3 in service (each ring's own server and one
// extra), and each ring's own server always serves.
func TestWorkerBudgetSharedByRings(t *testing.T) {
	p, d := startProbeRings(t, 2, 1)
	var wg sync.WaitGroup
	for ring := 1; ring <= 2; ring++ {
		var reqs [][40]byte
		for i := range 24 {
			reqs = append(reqs, request(uint64(1+i%4), true, 2*time.Millisecond))
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			submitOn(t, d, ring, reqs)
		}()
	}
	wg.Wait()
	if _, maxBusy := p.seen(); maxBusy > 3 {
		t.Errorf("%d requests in service at once with 2 rings and a budget of 1 extra server", maxBusy)
	}
	for ring := 1; ring <= 2; ring++ {
		if n := p.ringSeen(ring); n < 1 || n > 2 {
			t.Errorf("ring %d had %d requests in service at once, want 1 or 2", ring, n)
		}
	}
}

// TestRepliesSignalled: a server signals once its unsignalled replies are
// at least as many as the chains it saw waiting, and before it waits: for
// a batch of 32 published at once, after 16, 24, 28, 30, 31 and 32 replies
// (6 interrupts; fewer where the front end had not re-armed), never once
// per reply, and no reply is left unsignalled (the front end collects
// replies only on interrupts, so a missing signal is a timeout in submit).
// One request at a time, each reply is signalled at once.
func TestRepliesSignalled(t *testing.T) {
	for _, heavy := range []bool{false, true} {
		t.Run(fmt.Sprintf("heavy=%v", heavy), func(t *testing.T) {
			_, d := startProbe(t, 0)
			var reqs [][40]byte
			for i := range 32 {
				reqs = append(reqs, request(uint64(1+i%4), heavy, 300*time.Microsecond))
			}
			before := d.Queue(1).Stats().Interrupts
			submit(t, d, reqs)
			n := d.Queue(1).Stats().Interrupts - before
			t.Logf("%d interrupts", n)
			if n < 1 || n > 6 {
				t.Errorf("%d interrupts for %d replies, want 1 to 6", n, len(reqs))
			}
			before = d.Queue(1).Stats().Interrupts
			for range 8 {
				submit(t, d, reqs[:1])
			}
			if n := d.Queue(1).Stats().Interrupts - before; n != 8 {
				t.Errorf("%d interrupts for 8 requests one at a time, want 8", n)
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
// kicks once.
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

// TestFaultStopsRing: a server that faults on guest memory loses its chain
// and stops the ring, and the daemon goes on: the ring's other server
// finishes what it holds, GET_VRING_BASE answers with every chain taken
// counted, the lost chain lets go of the memory table it was translated
// with, and the ring, restarted, serves again.
func TestFaultStopsRing(t *testing.T) {
	p, d := startProbe(t, 1) // two servers
	mapped := guestRAMMappings(t, d)
	// Two heavy reads: the first wakes the second server for the second.
	calls := addPaged(t, d, readRequest(1, 50*time.Millisecond, true), readRequest(2, 5*time.Millisecond, false))
	for deadline := time.Now().Add(5 * time.Second); p.served.Load() < 1; {
		if time.Now().After(deadline) {
			t.Fatal("the second read was not served within 5 s")
		}
		time.Sleep(time.Millisecond)
	}
	if _, err := calls[1].Wait(5 * time.Second); err != nil {
		t.Fatal(err)
	}
	time.Sleep(100 * time.Millisecond) // the first read faults
	base, err := d.StopQueue(1)
	if err != nil {
		t.Fatal(err)
	}
	if u := d.Queue(1).UsedIdx(); base != 2 || u != 1 {
		t.Errorf("ring stopped at base %d with used index %d, want 2 and 1 (the faulting read lost)", base, u)
	}
	// As a guest resets the device after such a stop: fresh rings, the
	// lost chain abandoned. A new table (SET_MEM_TABLE) meanwhile must be
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
