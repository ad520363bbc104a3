package integration

// Dirty-page logging (LOG_SHMFD, VHOST_F_LOG_ALL), as QEMU ≥ 8.2 uses it to
// migrate a VM: while logging is on, the daemon must set the bit of every
// guest page it writes (reply and READ data, used-ring writes of rings with
// VHOST_VRING_F_LOG) and no other, keep setting them across a log
// replacement without touching the old log after its reply, and stop when
// logging stops.

import (
	"fmt"
	"maps"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/govirtiofsd/govirtiofsd/test/vmm"
)

// logged starts a daemon with a mounted session and a file "data" of
// dataLen bytes opened on ring 1, and turns logging on.
type logged struct {
	d    *daemon
	dev  *vmm.Device
	c    *fsc
	log  *vmm.DirtyLog
	node uint64
	fh   uint64
}

const dataLen = 3*4096 + 2048

func startLogged(t *testing.T) *logged {
	t.Helper()
	o := opts()
	o.Queues = 3 // hiprio and two request rings
	// At 1024 entries the used ring spans three pages: the pages of its
	// index and of its entries differ, and both must be logged.
	o.QueueSize = 1024
	d := startDaemon(t)
	d.writeHostFile("data", pattern(7, dataLen))
	for i := range 5 {
		d.writeHostFile(fmt.Sprintf("entry-%d", i), nil)
	}
	dev := d.connect(o)
	if !dev.HasProtocol(vmm.PLogShmfd) || dev.Offered&vmm.Bit(vmm.FLogAll) == 0 {
		t.Fatalf("LOG_SHMFD (protocol %#x) or LOG_ALL (features %#x) not offered", dev.OfferedProtocol, dev.Offered)
	}
	c := newFS(t, dev, 1)
	c.mount()
	node := c.lookup(vmm.RootID, "data").NodeID
	l := &logged{d: d, dev: dev, c: c, node: node, fh: c.open(node, 0)}
	var err error
	if l.log, err = vmm.NewDirtyLogFor(dev.Mem); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.log.Close() })
	if err := dev.StartLogging(l.log); err != nil {
		t.Fatalf("start logging: %v", err)
	}
	return l
}

// idle waits until the daemon has gone to sleep on every ring (its last
// avail_event writes done), then clears the log as QEMU's first sync does.
func (l *logged) idle() {
	time.Sleep(50 * time.Millisecond)
	l.log.Sync()
}

// request submits r on ring 1 and returns the used length and the pages of
// the first used bytes of its writable buffers: what the daemon wrote.
func (l *logged) request(t *testing.T, r vmm.FuseRequest) (uint32, map[uint64]bool) {
	t.Helper()
	q := l.dev.Queue(1)
	fc, err := q.SubmitFuse(r)
	if err != nil {
		t.Fatal(err)
	}
	segs := slices.Clone(fc.Writable())
	if _, err := fc.Wait(opTimeout); err != nil {
		t.Fatal(err)
	}
	n := fc.UsedLen()
	written := map[uint64]bool{}
	for left, i := uint64(n), 0; left > 0; i++ {
		k := min(left, uint64(segs[i].Len))
		for _, p := range vmm.PagesOf(segs[i].Addr, k) {
			written[p] = true
		}
		left -= k
	}
	return n, written
}

// ringPages returns the pages of ring q the daemon writes when it returns
// a chain: required, those of the last used entry written (split: the used
// ring's index and the entry before used.idx; packed: the used descriptor
// in the slot before the driver's next used slot, every request here taking
// one slot), and allowed, those it may write at any time (split:
// avail_event; packed: the device event area).
func ringPages(q *vmm.Queue) (required []uint64, allowed uint64) {
	a := q.Addrs()
	n := uint64(q.Size())
	if q.Packed() {
		q.Harvest()
		i, _ := q.NextUsed()
		slot := (uint64(i) + n - 1) % n
		return []uint64{(a.Desc + vmm.DescSize*slot) / vmm.LogPageSize}, a.Used / vmm.LogPageSize
	}
	slot := uint64((q.UsedIdx() - 1) % uint16(n))
	return []uint64{a.Used / vmm.LogPageSize, (a.Used + 4 + 8*slot) / vmm.LogPageSize}, (a.Used + 4 + 8*n) / vmm.LogPageSize
}

// usedCount is how far ring q's used position has moved from 0 (packed:
// within the first lap).
func usedCount(q *vmm.Queue) int {
	if q.Packed() {
		q.Harvest()
		i, _ := q.NextUsed()
		return int(i)
	}
	return int(q.UsedIdx())
}

// opendirRoot opens the shared directory's root for READDIR.
func (c *fsc) opendirRoot() uint64 {
	c.t.Helper()
	b, err := c.Call(vmm.OpOpendir, vmm.RootID, le32(le32(nil, 0), 0), nil, 16)
	if err != nil || len(b) != 16 {
		c.t.Fatalf("OPENDIR /: %d bytes, %v", len(b), err)
	}
	return le.Uint64(b)
}

func readReq(node, fh, off uint64, size uint32) vmm.FuseRequest {
	h := vmm.InHeader{Opcode: vmm.OpRead, Unique: 1 << 40, NodeID: node}
	return vmm.FuseRequest{In: vmm.BuildRequest(h, 0, vmm.ReadWriteIn(fh, off, size, 0)), OutPages: int(size)}
}

// TestDirtyLogExactPages: for READs (full and short), READDIR, a small
// reply and an error reply, the log holds the pages of the bytes the reply
// wrote, and the used-ring pages of ring 1, and no other page: not the
// untouched pages of a short READ's buffer, not the request's readable
// buffers.
func TestDirtyLogExactPages(t *testing.T) {
	l := startLogged(t)
	q := l.dev.Queue(1)
	dirFH := l.c.opendirRoot()
	// Move ring 1's used index to entries that live in another page than
	// the index itself.
	// (On a packed ring: used descriptors in another page than the
	// ring's first.)
	for usedCount(q) < 600 {
		l.c.getattr(l.node)
	}
	if r, _ := ringPages(q); len(r) == 2 && r[0] == r[1] || len(r) == 1 && r[0] == q.Addrs().Desc/vmm.LogPageSize {
		t.Fatalf("used entry %d in the ring's first page: the test would not tell them apart", usedCount(q))
	}
	cases := []struct {
		name string
		req  vmm.FuseRequest
		want uint32 // used length
	}{
		{"read-full", readReq(l.node, l.fh, 0, 3*4096), 16 + 3*4096},
		{"read-short", readReq(l.node, l.fh, 3*4096, 3*4096), 16 + 2048},
		{"read-eof", readReq(l.node, l.fh, dataLen, 2*4096), 16},
		{"readdir", vmm.FuseRequest{In: vmm.BuildRequest(vmm.InHeader{Opcode: vmm.OpReaddir, Unique: 2, NodeID: vmm.RootID},
			0, vmm.ReadWriteIn(dirFH, 0, 3*4096, 0)), OutPages: 3 * 4096}, 0},
		{"getattr", vmm.FuseRequest{In: vmm.BuildRequest(vmm.InHeader{Opcode: vmm.OpGetattr, Unique: 3, NodeID: l.node},
			0, make([]byte, 16)), OutArgs: 104}, 16 + 104},
		{"lookup-enoent", vmm.FuseRequest{In: vmm.BuildRequest(vmm.InHeader{Opcode: vmm.OpLookup, Unique: 4, NodeID: vmm.RootID},
			0, []byte("missing\x00")), OutArgs: 128}, 16},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			l.idle()
			n, written := l.request(t, tc.req)
			if tc.want != 0 && n != tc.want {
				t.Fatalf("used length %d, want %d", n, tc.want)
			}
			if n <= 16 && tc.name == "readdir" {
				t.Fatalf("READDIR answered %d bytes: no entries", n)
			}
			ring, _ := ringPages(q)
			required := maps.Clone(written)
			for _, p := range ring {
				required[p] = true
			}
			// The daemon may also write avail_event (packed: the
			// device event area) of any logging ring (it does when a
			// server goes to sleep).
			allowed := maps.Clone(required)
			for _, rq := range l.dev.Queues {
				_, ae := ringPages(rq)
				allowed[ae] = true
			}
			got := l.log.Pages()
			for p := range required {
				if !got[p] {
					t.Errorf("page %#x written but not logged", p*vmm.LogPageSize)
				}
			}
			for p := range got {
				if !allowed[p] {
					t.Errorf("page %#x logged but not written by this reply", p*vmm.LogPageSize)
				}
			}
			t.Logf("used len %d: %d pages logged (%d of data and reply)", n, len(got), len(written))
		})
	}
	noViolations(t, l.dev)
}

// TestDirtyLogStops: logging turned off as QEMU does after a cancelled
// migration (SET_FEATURES without LOG_ALL, SET_VRING_ADDR flags 0 with no
// reply awaited) really stops: the log stays empty however much is served.
// Turned on again, it logs again.
func TestDirtyLogStops(t *testing.T) {
	l := startLogged(t)
	l.idle()
	if _, w := l.request(t, readReq(l.node, l.fh, 0, 4096)); len(l.log.Pages()) < len(w) {
		t.Fatalf("logging on: %d pages logged, want at least %d", len(l.log.Pages()), len(w))
	}
	if err := l.dev.StopLogging(); err != nil {
		t.Fatal(err)
	}
	l.idle()
	for i := range 20 {
		l.request(t, readReq(l.node, l.fh, uint64(i%3)*4096, 4096))
	}
	time.Sleep(50 * time.Millisecond)
	if got := l.log.Pages(); len(got) != 0 {
		t.Fatalf("logging off: %d pages logged", len(got))
	}
	if err := l.dev.StartLogging(l.log); err != nil {
		t.Fatalf("start logging again: %v", err)
	}
	l.idle()
	if _, w := l.request(t, readReq(l.node, l.fh, 0, 4096)); len(l.log.Pages()) < len(w) {
		t.Fatalf("logging on again: %d pages logged, want at least %d", len(l.log.Pages()), len(w))
	}
	l.c.roundTrip(l.d, "after", pattern(2, 9000))
	noViolations(t, l.dev)
}

// TestDirtyLogReplaced: SET_LOG_BASE replaces the log while READs stream
// on two rings. Every page a completed READ wrote is in one of the logs, and
// after its reply the daemon never again writes the old log (QEMU syncs
// and frees it at once).
func TestDirtyLogReplaced(t *testing.T) {
	l := startLogged(t)
	var (
		mu      sync.Mutex
		written = map[uint64]bool{}
		stop    = make(chan struct{})
		wg      sync.WaitGroup
	)
	for _, ring := range []int{1, 2} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			q := l.dev.Queue(ring)
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				fc, err := q.SubmitFuse(readReq(l.node, l.fh, uint64(i%3)*4096, 8192))
				if err != nil {
					t.Error(err)
					return
				}
				segs := slices.Clone(fc.Writable())
				if _, err := fc.Wait(opTimeout); err != nil {
					t.Error(err)
					return
				}
				mu.Lock()
				for left, j := uint64(fc.UsedLen()), 0; left > 0; j++ {
					k := min(left, uint64(segs[j].Len))
					for _, p := range vmm.PagesOf(segs[j].Addr, k) {
						written[p] = true
					}
					left -= k
				}
				mu.Unlock()
			}
		}()
	}
	logs := []*vmm.DirtyLog{l.log}
	var frozen []map[uint64]bool // each old log as it was at its replacement's reply
	for range 10 {
		time.Sleep(20 * time.Millisecond)
		nl, err := vmm.NewDirtyLogFor(l.dev.Mem)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { nl.Close() })
		if err := l.dev.SetLogBaseFor(nl); err != nil {
			t.Fatalf("replace the log: %v", err)
		}
		frozen = append(frozen, logs[len(logs)-1].Pages())
		logs = append(logs, nl)
	}
	time.Sleep(20 * time.Millisecond)
	close(stop)
	wg.Wait()
	union := map[uint64]bool{}
	for i, lg := range logs {
		got := lg.Pages()
		if i < len(frozen) && !maps.Equal(got, frozen[i]) {
			t.Errorf("log %d changed after the daemon answered its replacement (%d pages then, %d now)", i, len(frozen[i]), len(got))
		}
		maps.Copy(union, got)
	}
	missing := 0
	for p := range written {
		if !union[p] {
			missing++
		}
	}
	if missing > 0 {
		t.Errorf("%d of %d written pages in no log", missing, len(written))
	}
	t.Logf("%d pages written by READs, %d logs", len(written), len(logs))
	noViolations(t, l.dev)
}

// TestDirtyLogAcrossRestart: a device started while logging is on, as a
// guest reset during a migration does (SET_FEATURES with LOG_ALL before
// the rings, SET_VRING_ADDR with the log flag, SET_LOG_BASE last), logs
// from its first request.
func TestDirtyLogAcrossRestart(t *testing.T) {
	l := startLogged(t)
	if _, err := l.dev.Stop(); err != nil {
		t.Fatal(err)
	}
	if err := l.dev.Restart(false); err != nil {
		t.Fatalf("restart while logging: %v", err)
	}
	l.idle()
	_, written := l.request(t, readReq(l.node, l.fh, 0, 2*4096))
	got := l.log.Pages()
	for p := range written {
		if !got[p] {
			t.Errorf("page %#x written after the restart but not logged", p*vmm.LogPageSize)
		}
	}
	noViolations(t, l.dev)
}
