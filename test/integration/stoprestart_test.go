package integration

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/govirtiofsd/govirtiofsd/test/vmm"
)

// TestStopRestartExact is the pause/resume contract of GET_VRING_BASE: on a
// ring with requests in flight, and with the guest kicking concurrently,
// SET_VRING_ENABLE 0 + GET_VRING_BASE stops the ring and returns the next
// avail index to process, after every request taken has been answered and
// pushed (so base == used.idx, and used.idx does not move while stopped);
// restarting there executes every request exactly once.
//
// Each iteration publishes one WRITE per file (64 files opened O_APPEND),
// each appending a unique record; the host files must end up holding each
// record exactly once, in order.
//
// GOVIRTIOFSD_STRESS_ITER sets the iteration count (default 1000 cycles:
// about 30 s with the race detector).
func TestStopRestartExact(t *testing.T) {
	iters := envInt("GOVIRTIOFSD_STRESS_ITER", 1000)
	cases := []struct {
		name     string
		features uint64
		size     uint16
		iters    int
		recLen   int
	}{
		{"event-idx-q128", 0, 128, iters, 16},
		// Multi-page, unaligned writes: the daemon is busy when the stop
		// comes.
		{"no-event-idx-q1024-16KiB-records", vmm.DefaultFeatures &^ vmm.Bit(vmm.FEventIdx), 1024, max(iters/4, 10), 16*1024 + 16},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			d := startDaemon(t)
			o := opts()
			o.Features, o.QueueSize = tc.features, tc.size
			dev := d.connect(o)
			stopRestartLoop(t, d, dev, tc.iters, tc.recLen)
		})
	}
}

const stressFiles = 64

// pendingAfter is how many slots (split: avail entries) the driver has
// made available beyond base, the stopped ring's GET_VRING_BASE; negative
// if base lies beyond them.
func pendingAfter(q *vmm.Queue, base uint32) int {
	if !q.Packed() {
		if n := q.AvailIdx() - uint16(base); n <= stressFiles {
			return int(n)
		}
		return -1
	}
	b := vmm.ParsePackedBase(base)
	i, w := q.NextAvail()
	n := int(i) - int(b.AvailIdx)
	if w != b.AvailWrap {
		n += int(q.Size())
	}
	if n < 0 || n > int(q.Size()) {
		return -1
	}
	return n
}

// record is the unique record of one iteration for one file: a 16-byte tag
// repeated to n bytes.
func record(iter, file, n int) []byte {
	tag := fmt.Appendf(nil, "%08d:%02d:%03d\n", iter, file, iter%997)[:16]
	return bytes.Repeat(tag, n/16)
}

func stopRestartLoop(t *testing.T, d *daemon, dev *vmm.Device, iters, recordLen int) {
	c := newFS(t, dev, 1)
	c.mount()
	var nodes, fhs [stressFiles]uint64
	for i := range stressFiles {
		nodes[i], fhs[i] = c.create(vmm.RootID, fmt.Sprintf("log%02d", i), syscall.O_WRONLY|syscall.O_APPEND)
	}
	q := dev.Queue(1)
	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 1))
	start := time.Now()
	var stopsMidSubmit, stopsWithPending int
	for it := range iters {
		oneIteration := func() {
			calls := make([]*vmm.FuseCall, stressFiles)
			uniques := make([]uint64, stressFiles)
			stopAt := rng.IntN(stressFiles + 1)
			var published atomic.Int32
			var submitErr error
			submitDone := make(chan struct{})
			kickStop := make(chan struct{})
			var wg sync.WaitGroup
			// Whatever happens, no goroutine may touch the device after this
			// iteration (the cleanup unmaps guest memory).
			defer func() {
				close(kickStop)
				wg.Wait()
				<-submitDone
			}()

			// The guest kicks (as if several vCPUs submitted) around the stop.
			wg.Go(func() {
				for {
					select {
					case <-kickStop:
						return
					default:
					}
					q.Kick()
					runtime.Gosched()
				}
			})
			go func() {
				defer close(submitDone)
				for i := range stressFiles {
					h := c.Header(vmm.OpWrite, nodes[i])
					uniques[i] = h.Unique
					rec := record(it, i, recordLen)
					in := vmm.BuildRequest(h, len(rec), vmm.ReadWriteIn(fhs[i], uint64(it*recordLen), uint32(len(rec)), 0))
					mode := vmm.IndirectAuto
					if i%8 == 0 {
						mode = vmm.IndirectNever
					}
					fc, err := q.SubmitFuse(vmm.FuseRequest{In: in, InPages: rec, OutArgs: 8, Indirect: mode})
					if err != nil {
						submitErr = fmt.Errorf("iteration %d: submit %d: %w", it, i, err)
						return
					}
					calls[i] = fc
					published.Add(1)
					if rng.IntN(4) == 0 {
						runtime.Gosched()
					}
				}
			}()
			for int(published.Load()) < stopAt {
				select {
				case <-submitDone:
				default:
					runtime.Gosched()
					continue
				}
				break
			}
			base, err := dev.StopQueue(1)
			if err != nil {
				t.Fatalf("iteration %d: stop: %v", it, err)
			}
			usedStop, err := usedAtStop(q, base)
			if err != nil {
				t.Fatalf("iteration %d: %v", it, err)
			}
			if published.Load() < stressFiles {
				stopsMidSubmit++
			}
			<-submitDone
			if submitErr != nil {
				t.Fatal(submitErr)
			}
			if pending := pendingAfter(q, base); pending < 0 {
				t.Fatalf("iteration %d: GET_VRING_BASE = %#x beyond what the driver made available", it, base)
			} else if pending > 0 {
				stopsWithPending++
			}
			// The stopped ring must stay still while the guest keeps kicking.
			for range 20 {
				q.Kick()
				runtime.Gosched()
			}
			q.Harvest()
			if u := usedNow(q); u != usedStop {
				t.Fatalf("iteration %d: the used position moved from %#x to %#x after GET_VRING_BASE", it, usedStop, u)
			}
			if err := dev.RestartQueue(1, base, false); err != nil {
				t.Fatalf("iteration %d: restart at %d: %v", it, base, err)
			}
			for i, fc := range calls {
				b, err := fc.Wait(opTimeout)
				if err != nil {
					t.Fatalf("iteration %d: write %d: %v (ring stats %+v, base %#x, idle base %#x)",
						it, i, err, q.Stats(), base, q.IdleBase())
				}
				h, body, err := vmm.ParseReply(b)
				switch {
				case err != nil:
					t.Fatalf("iteration %d: write %d: %v", it, i, err)
				case h.Unique != uniques[i]:
					t.Fatalf("iteration %d: write %d: reply unique %d, want %d", it, i, h.Unique, uniques[i])
				case h.Error != 0 || len(body) != 8 || le.Uint32(body) != uint32(recordLen):
					t.Fatalf("iteration %d: write %d: error %d, body %x", it, i, h.Error, body)
				}
			}
			if v := q.Violations(); len(v) > 0 {
				t.Fatalf("iteration %d: %v", it, v)
			}
			if q.InFlight() != 0 {
				t.Fatalf("iteration %d: %d chains still in flight", it, q.InFlight())
			}
		}
		oneIteration()
	}
	t.Logf("%d iterations in %v: %d stops while the guest was still submitting, %d with chains left for the restart",
		iters, time.Since(start).Round(time.Millisecond), stopsMidSubmit, stopsWithPending)
	for i := range stressFiles {
		var want []byte
		for it := range iters {
			want = append(want, record(it, i, recordLen)...)
		}
		got := d.hostFile(fmt.Sprintf("log%02d", i))
		if !bytes.Equal(got, want) {
			at := firstDiff(got, want)
			t.Errorf("log%02d: %d bytes, want %d; first difference in record %d: got %q", i, len(got), len(want),
				at/recordLen, got[at/16*16:min(len(got), at/16*16+16)])
		}
	}
	noViolations(t, dev)
}

// TestStopRestartAllRings pauses and resumes the whole device (QEMU's
// vhost_dev_stop/start) while requests run on two request rings.
func TestStopRestartAllRings(t *testing.T) {
	d := startDaemon(t)
	o := opts()
	o.Queues = 3
	dev := d.connect(o)
	c := newFS(t, dev, 1)
	c.mount()
	for round := range 20 {
		var wg sync.WaitGroup
		var calls [2][]*vmm.FuseCall
		for r := range 2 {
			q := dev.Queue(r + 1)
			s := vmm.NewSession(dev, r+1)
			for range 16 {
				in := vmm.BuildRequest(s.Header(vmm.OpGetattr, vmm.RootID), 0, make([]byte, 16))
				fc, err := q.SubmitFuse(vmm.FuseRequest{In: in, OutArgs: vmm.FuseAttrOutSize})
				if err != nil {
					t.Fatal(err)
				}
				calls[r] = append(calls[r], fc)
			}
		}
		bases, err := dev.Stop()
		if err != nil {
			t.Fatalf("round %d: stop: %v", round, err)
		}
		for i, b := range bases {
			if _, err := usedAtStop(dev.Queue(i), b); err != nil {
				t.Fatalf("round %d: ring %d: %v", round, i, err)
			}
		}
		if err := dev.Restart(false); err != nil {
			t.Fatalf("round %d: restart: %v", round, err)
		}
		for r := range 2 {
			for _, fc := range calls[r] {
				wg.Go(func() {
					b, err := fc.Wait(opTimeout)
					if err != nil {
						t.Errorf("round %d ring %d: %v", round, r+1, err)
						return
					}
					if h, _, err := vmm.ParseReply(b); err != nil || h.Error != 0 {
						t.Errorf("round %d ring %d: %+v %v", round, r+1, h, err)
					}
				})
			}
		}
		wg.Wait()
		if t.Failed() {
			return
		}
	}
	c.roundTrip(d, "after", pattern(1, 10000))
	noViolations(t, dev)
}

// TestGuestReset: a guest reboot (rings stopped, restarted in new memory at
// base 0) followed by FUSE_INIT resets the file system session: handles of
// the old session are gone, the files are intact, and DESTROY + INIT
// (umount + mount) on the same connection works too.
func TestGuestReset(t *testing.T) {
	d := startDaemon(t)
	dev := d.connect(opts())
	c := newFS(t, dev, 1)
	c.mount()
	node, fh := c.create(vmm.RootID, "kept", syscall.O_RDWR)
	c.write(node, fh, 0, []byte("before reboot"))
	for range 5 {
		if err := dev.GuestReset(); err != nil {
			t.Fatalf("guest reset: %v", err)
		}
		c.mount()
		if _, err := c.Read(node, fh, 0, 13); err == nil {
			t.Errorf("READ with a file handle of the session before the reset succeeded")
		}
		e := c.lookup(vmm.RootID, "kept")
		if e.Attr.Size != 13 {
			t.Errorf("after reset: size %d", e.Attr.Size)
		}
		node = e.NodeID
		fh = c.open(node, syscall.O_RDWR)
		if got := c.read(node, fh, 0, 13); string(got) != "before reboot" {
			t.Errorf("after reset: read %q", got)
		}
	}
	// umount + mount on the same connection.
	if err := c.Destroy(); err != nil {
		t.Fatalf("DESTROY: %v", err)
	}
	c.mount()
	c.roundTrip(d, "after-remount", pattern(1, 8192))
	noViolations(t, dev)
}

// TestGuestResetInFlight: a reboot while requests are in flight on the old
// rings; the daemon answers what it took, the rest are abandoned, and the
// new rings start clean.
func TestGuestResetInFlight(t *testing.T) {
	d := startDaemon(t)
	o := opts()
	o.QueueSize = 1024
	dev := d.connect(o)
	c := newFS(t, dev, 1)
	c.mount()
	node, fh := c.create(vmm.RootID, "big", syscall.O_RDWR)
	for round := range 10 {
		q := dev.Queue(1)
		for i := range 32 {
			data := pattern(i, 64*1024)
			in := vmm.BuildRequest(c.Header(vmm.OpWrite, node), len(data), vmm.ReadWriteIn(fh, uint64(i)*64*1024, uint32(len(data)), 0))
			if _, err := q.SubmitFuse(vmm.FuseRequest{In: in, InPages: data, OutArgs: 8}); err != nil {
				t.Fatal(err)
			}
		}
		if err := dev.GuestReset(); err != nil {
			t.Fatalf("round %d: guest reset: %v", round, err)
		}
		c.mount()
		node = c.lookup(vmm.RootID, "big").NodeID
		fh = c.open(node, syscall.O_RDWR)
	}
	c.roundTrip(d, "after", pattern(9, 4096))
	noViolations(t, dev)
}

// TestStopRestartSameFileWrites: with two request rings, large O_APPEND
// writes to the same two files arrive on both rings, served side by side by
// the rings' servers. Ring 2 is stopped and restarted again and again while
// that goes on; GET_VRING_BASE must still equal ring 2's used.idx (every
// chain it popped is answered before the stop is), and after all
// iterations each record is in its file exactly once.
func TestStopRestartSameFileWrites(t *testing.T) {
	iters := max(envInt("GOVIRTIOFSD_STRESS_ITER", 1000)/10, 10)
	const (
		files     = 2
		perRing   = 6
		recordLen = 64 << 10 // large (32 KiB and up): may wake a second server
	)
	d := startDaemon(t, "--queues", "2")
	o := opts()
	o.Queues = 3
	dev := d.connect(o)
	c := newFS(t, dev, 1)
	c.mount()
	var nodes, fhs [files]uint64
	for i := range files {
		nodes[i], fhs[i] = c.create(vmm.RootID, fmt.Sprintf("shared%d", i), syscall.O_WRONLY|syscall.O_APPEND)
	}
	tag := func(it, ring, i int) []byte {
		return fmt.Appendf(nil, "%07d:%d:%02d:%03d\n", it, ring, i, it%997)[:16]
	}
	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 2))
	q2 := dev.Queue(2)
	for it := range iters {
		var calls []*vmm.FuseCall
		for i := range perRing {
			for ring := 1; ring <= 2; ring++ {
				f := i % files
				h := c.Header(vmm.OpWrite, nodes[f])
				rec := bytes.Repeat(tag(it, ring, i), recordLen/16)
				in := vmm.BuildRequest(h, len(rec), vmm.ReadWriteIn(fhs[f], 0, uint32(len(rec)), 0))
				fc, err := dev.Queue(ring).SubmitFuse(vmm.FuseRequest{In: in, InPages: rec, OutArgs: 8})
				if err != nil {
					t.Fatalf("iteration %d: submit on ring %d: %v", it, ring, err)
				}
				calls = append(calls, fc)
			}
		}
		for range rng.IntN(64) {
			runtime.Gosched()
		}
		base, err := dev.StopQueue(2)
		if err != nil {
			t.Fatalf("iteration %d: stop ring 2: %v", it, err)
		}
		if _, err := usedAtStop(q2, base); err != nil {
			t.Fatalf("iteration %d: ring 2: %v", it, err)
		}
		if err := dev.RestartQueue(2, base, false); err != nil {
			t.Fatalf("iteration %d: restart ring 2 at %d: %v", it, base, err)
		}
		for k, fc := range calls {
			b, err := fc.Wait(opTimeout)
			if err != nil {
				t.Fatalf("iteration %d: write %d: %v", it, k, err)
			}
			h, body, err := vmm.ParseReply(b)
			if err != nil || h.Error != 0 || len(body) != 8 || le.Uint32(body) != recordLen {
				t.Fatalf("iteration %d: write %d: error %v/%d, body %x", it, k, err, h.Error, body)
			}
		}
	}
	for f := range files {
		got := d.hostFile(fmt.Sprintf("shared%d", f))
		seen := map[string]int{}
		for off := 0; off+recordLen <= len(got); off += recordLen {
			r := got[off : off+recordLen]
			if !bytes.Equal(r, bytes.Repeat(r[:16], recordLen/16)) {
				t.Fatalf("shared%d: record at %d is torn", f, off)
			}
			seen[string(r[:16])]++
		}
		want := iters * 2 * perRing / files
		if len(got) != want*recordLen {
			t.Errorf("shared%d: %d bytes, want %d records of %d", f, len(got), want, recordLen)
		}
		for it := range iters {
			for ring := 1; ring <= 2; ring++ {
				for i := f; i < perRing; i += files {
					if n := seen[string(tag(it, ring, i))]; n != 1 {
						t.Fatalf("shared%d: record of iteration %d, ring %d, write %d found %d times", f, it, ring, i, n)
					}
				}
			}
		}
	}
	noViolations(t, dev)
}
