package integration

import (
	"bytes"
	"fmt"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/govirtiofsd/govirtiofsd/test/vmm"
)

// hotplugLayout is QEMU's split layout plus a DIMM at 8 GiB that is not
// announced at start.
func hotplugLayout(o *vmm.Options) {
	o.Layout = append(vmm.SplitLayout(32*vmm.MiB, 32*vmm.MiB),
		vmm.RegionSpec{GuestPhysAddr: 8 * vmm.GiB, Size: 32 * vmm.MiB, File: 2})
	o.Hotplug = []int{2}
}

// TestRegionsSurviveStopStart: with CONFIGURE_MEM_SLOTS, QEMU does not
// resend the regions when it restarts the rings; the daemon must keep them.
func TestRegionsSurviveStopStart(t *testing.T) {
	d := startDaemon(t)
	dev := d.connect(opts())
	c := newFS(t, dev, 1)
	c.mount()
	adds := d.logCount("request=ADD_MEM_REG")
	if adds != 2 {
		t.Fatalf("%d ADD_MEM_REG at start, want 2", adds)
	}
	for round := range 5 {
		if _, err := dev.Stop(); err != nil {
			t.Fatal(err)
		}
		if err := dev.Restart(round%2 == 1); err != nil {
			t.Fatal(err)
		}
		if round%2 == 1 {
			c.mount() // a reboot: new session
		}
		c.roundTrip(d, fmt.Sprintf("r%d", round), pattern(round, 50000))
	}
	if n := d.logCount("request=ADD_MEM_REG"); n != adds {
		t.Errorf("ADD_MEM_REG sent %d times, want %d (no resend)", n, adds)
	}
	if n := d.logCount("request=SET_MEM_TABLE"); n != 0 {
		t.Errorf("SET_MEM_TABLE sent %d times", n)
	}
	noViolations(t, dev)
}

// background runs FUSE requests on a ring until stopped and reports the
// first failure.
type background struct {
	stop chan struct{}
	done chan struct{}
	once sync.Once
	n    atomic.Int64
	err  error
}

// runBackground starts the loop; a cleanup (which runs before the device
// is closed) stops it at the latest.
func runBackground(t *testing.T, dev *vmm.Device, ring int) *background {
	b := &background{stop: make(chan struct{}), done: make(chan struct{})}
	t.Cleanup(b.halt)
	s := vmm.NewSession(dev, ring)
	go func() {
		defer close(b.done)
		for {
			select {
			case <-b.stop:
				return
			default:
			}
			if _, err := s.Getattr(vmm.RootID); err != nil {
				b.err = fmt.Errorf("background GETATTR on ring %d: %w", ring, err)
				return
			}
			b.n.Add(1)
		}
	}()
	return b
}

func (b *background) halt() {
	b.once.Do(func() { close(b.stop) })
	<-b.done
}

func (b *background) finish(t *testing.T) {
	t.Helper()
	b.halt()
	if b.err != nil {
		t.Error(b.err)
	}
	if b.n.Load() == 0 {
		t.Error("background ring served nothing")
	}
}

// TestMemoryHotplug: regions added (ADD_MEM_REG, or a new SET_MEM_TABLE
// without CONFIGURE_MEM_SLOTS) while rings run are usable at once; after
// removal, a request whose buffers point there is malformed (used len 0)
// and the next valid request on the same ring works.
func TestMemoryHotplug(t *testing.T) {
	for _, tc := range []struct {
		name     string
		protocol uint64
		indirect vmm.IndirectMode
	}{
		{"add-mem-reg", 0, vmm.IndirectAuto},
		{"add-mem-reg-direct", 0, vmm.IndirectNever},
		{"set-mem-table", vmm.QEMUProtocolFeatures &^ vmm.Bit(vmm.PConfigureMemSlots), vmm.IndirectAuto},
		{"set-mem-table-direct", vmm.QEMUProtocolFeatures &^ vmm.Bit(vmm.PConfigureMemSlots), vmm.IndirectNever},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := startDaemon(t)
			o := opts()
			o.ProtocolFeatures, o.Indirect, o.Queues = tc.protocol, tc.indirect, 3
			hotplugLayout(&o)
			dev := d.connect(o)
			c := newFS(t, dev, 1)
			c.mount()
			bg := runBackground(t, dev, 2)
			q := dev.Queue(1)
			for round := range 5 {
				if err := dev.AddRegion(2); err != nil {
					t.Fatalf("round %d: hotplug: %v", round, err)
				}
				q.SetBufRegion(2)
				c.roundTrip(d, fmt.Sprintf("hot%d", round), pattern(round, 40000))
				if err := dev.RemoveRegion(2); err != nil {
					t.Fatalf("round %d: unplug: %v", round, err)
				}
				// Buffers (and the indirect table) in the removed region.
				in := vmm.BuildRequest(c.Header(vmm.OpGetattr, vmm.RootID), 0, make([]byte, 16))
				reply, err := dev.DoRequest(1, vmm.FuseRequest{In: in, OutArgs: vmm.FuseAttrOutSize, Indirect: tc.indirect})
				if err != nil || len(reply) != 0 {
					t.Fatalf("round %d: request into the removed region: used len %d, %v; want 0", round, len(reply), err)
				}
				q.SetBufRegion(1)
				c.roundTrip(d, fmt.Sprintf("cold%d", round), pattern(round+10, 5000))
			}
			// Stop/start after the hotplug dance: the table is intact.
			if _, err := dev.Stop(); err != nil {
				t.Fatal(err)
			}
			if err := dev.Restart(false); err != nil {
				t.Fatal(err)
			}
			c.check()
			bg.finish(t)
			noViolations(t, dev)
		})
	}
}

// TestRemoveRegionInFlight: a region is removed while requests whose data
// lives there are in flight. Each request either completes normally (it
// was taken before the removal: its mapping must stay valid until it is
// done) or is refused with used len 0; nothing crashes, and the completed
// writes are on the host.
func TestRemoveRegionInFlight(t *testing.T) {
	d := startDaemon(t)
	o := opts()
	o.QueueSize = 1024
	hotplugLayout(&o)
	dev := d.connect(o)
	c := newFS(t, dev, 1)
	c.mount()
	q := dev.Queue(1)
	var completed, refused int
	const chunk = 128 * 1024
	for round := range 6 {
		if err := dev.AddRegion(2); err != nil {
			t.Fatal(err)
		}
		q.SetBufRegion(2)
		name := fmt.Sprintf("f%d", round)
		node, fh := c.create(vmm.RootID, name, syscall.O_RDWR)
		var calls []*vmm.FuseCall
		for i := range 16 {
			data := pattern(round*100+i, chunk)
			in := vmm.BuildRequest(c.Header(vmm.OpWrite, node), len(data), vmm.ReadWriteIn(fh, uint64(i)*chunk, uint32(len(data)), 0))
			fc, err := q.SubmitFuse(vmm.FuseRequest{In: in, InPages: data, OutArgs: 8})
			if err != nil {
				t.Fatal(err)
			}
			calls = append(calls, fc)
			if i == 8 {
				// Unplug with half the requests published.
				if err := dev.RemoveRegion(2); err != nil {
					t.Fatal(err)
				}
			}
		}
		var done []int
		for i, fc := range calls {
			b, err := fc.Wait(opTimeout)
			if err != nil {
				t.Fatalf("round %d write %d: %v", round, i, err)
			}
			if len(b) == 0 {
				refused++
				continue
			}
			completed++
			done = append(done, i)
			if h, body, err := vmm.ParseReply(b); err != nil || h.Error != 0 || le.Uint32(body) != chunk {
				t.Fatalf("round %d write %d: %+v %v", round, i, h, err)
			}
		}
		host := d.hostFile(name)
		for _, i := range done {
			off := i * chunk
			if len(host) < off+chunk || !bytes.Equal(host[off:off+chunk], pattern(round*100+i, chunk)) {
				t.Errorf("round %d write %d answered but not on the host", round, i)
			}
		}
		q.SetBufRegion(1)
		c.check()
	}
	t.Logf("%d writes completed before the removal, %d refused after it", completed, refused)
	noViolations(t, dev)
}

// TestCallFdSwapUnderLoad: SET_VRING_CALL replaces the call fd of running
// rings over and over (MSI-X mask/unmask) while requests are in flight; no
// interrupt may be lost (signalled on an fd the front end has already
// replaced) and every request completes.
func TestCallFdSwapUnderLoad(t *testing.T) {
	d := startDaemon(t)
	o := opts()
	o.Queues = 3
	dev := d.connect(o)
	c := newFS(t, dev, 1)
	c.mount()
	// The swapper: a fixed number of swaps (vmm keeps polling every
	// replaced fd, so they are bounded), alternating between two rings.
	const wantSwaps = 300
	var swaps atomic.Int64
	swapDone := make(chan struct{})
	var swapErr error
	go func() {
		defer close(swapDone)
		for i := range wantSwaps {
			ring := 1 + i%2
			fd, err := dev.Queue(ring).NewCallFd()
			if err == nil {
				err = dev.Conn.SetVringCall(uint32(ring), fd)
			}
			if err != nil {
				swapErr = err
				return
			}
			swaps.Add(1)
			time.Sleep(200 * time.Microsecond)
		}
	}()
	// The load: batches of 8 requests in flight on both rings, until the
	// swapper is done.
	var wg sync.WaitGroup
	errs := make(chan error, 2)
	var completed atomic.Int64
	for ring := 1; ring <= 2; ring++ {
		wg.Go(func() {
			s := vmm.NewSession(dev, ring)
			q := dev.Queue(ring)
			for batch := 0; ; batch++ {
				select {
				case <-swapDone:
					return
				default:
				}
				var calls []*vmm.FuseCall
				for range 8 {
					in := vmm.BuildRequest(s.Header(vmm.OpGetattr, vmm.RootID), 0, make([]byte, 16))
					fc, err := q.SubmitFuse(vmm.FuseRequest{In: in, OutArgs: vmm.FuseAttrOutSize})
					if err != nil {
						errs <- err
						return
					}
					calls = append(calls, fc)
				}
				for _, fc := range calls {
					if _, err := fc.Wait(opTimeout); err != nil {
						errs <- fmt.Errorf("ring %d batch %d: %w", ring, batch, err)
						return
					}
					completed.Add(1)
				}
			}
		})
	}
	wg.Wait()
	<-swapDone
	if swapErr != nil {
		t.Fatal(swapErr)
	}
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	t.Logf("%d call fd swaps during %d requests", swaps.Load(), completed.Load())
	// Let vmm's grace period for the last replaced fds pass: a late signal
	// on any of them would count as lost now.
	c.check()
	time.Sleep(1500 * time.Millisecond)
	c.check()
	noViolations(t, dev)
}

// TestShrunkMemfd: the front end shrinks a region's file after announcing
// it; a request touching the vanished pages must not kill the daemon (no
// SIGBUS crash). The ring may stop; a restart of it recovers.
func TestShrunkMemfd(t *testing.T) {
	d := startDaemon(t)
	o := opts()
	o.Queues = 3
	hotplugLayout(&o)
	dev := d.connect(o)
	c := newFS(t, dev, 1)
	c.mount()
	if err := dev.AddRegion(2); err != nil {
		t.Fatal(err)
	}
	q := dev.Queue(1)
	q.SetBufRegion(2)
	in := vmm.BuildRequest(c.Header(vmm.OpGetattr, vmm.RootID), 0, make([]byte, 16))
	fc, err := q.AddFuse(vmm.FuseRequest{In: in, OutArgs: vmm.FuseAttrOutSize})
	if err != nil {
		t.Fatal(err)
	}
	q.SetBufRegion(1)
	// Drop every page of the hot-plugged region's file (ours too: we do not
	// touch it any more).
	if err := unix.Ftruncate(dev.Mem.Regions()[2].Fd(), 0); err != nil {
		t.Fatal(err)
	}
	if err := q.Kick(); err != nil {
		t.Fatal(err)
	}
	select {
	case <-fc.Done():
		if fc.UsedLen() != 0 {
			t.Errorf("request on vanished pages: used len %d", fc.UsedLen())
		}
	case <-time.After(time.Second):
		t.Log("request on vanished pages not returned (the ring stopped)")
	}
	d.alive()
	// Another ring still serves.
	newFS(t, dev, 2).check()
	// Restarting the ring recovers it.
	base, err := dev.StopQueue(1)
	if err != nil {
		t.Fatal(err)
	}
	if err := dev.RemoveRegion(2); err != nil && replyErr(err) == 0 {
		t.Fatal(err)
	}
	if err := dev.RestartQueue(1, base, false); err != nil {
		t.Fatal(err)
	}
	c.roundTrip(d, "after-sigbus", pattern(1, 7000))
	for _, v := range q.Violations() {
		t.Error(v)
	}
}

// TestHotplugThenUseRace: a chain published after the front end received
// the acknowledgement of ADD_MEM_REG (or of a new SET_MEM_TABLE) must be
// translated with the new table, even when the ring's goroutine was busy
// (spurious kicks keep it looping) at the time of the update.
func TestHotplugThenUseRace(t *testing.T) {
	for _, tc := range []struct {
		name     string
		protocol uint64
	}{
		{"add-mem-reg", 0},
		{"set-mem-table", vmm.QEMUProtocolFeatures &^ vmm.Bit(vmm.PConfigureMemSlots)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := startDaemon(t)
			o := opts()
			o.ProtocolFeatures = tc.protocol
			hotplugLayout(&o)
			dev := d.connect(o)
			c := newFS(t, dev, 1)
			c.mount()
			q := dev.Queue(1)
			stop := make(chan struct{})
			done := make(chan struct{})
			go func() { // a guest kicking all the time
				defer close(done)
				for {
					select {
					case <-stop:
						return
					default:
					}
					q.Kick()
				}
			}()
			defer func() { close(stop); <-done }()
			for round := range 200 {
				if err := dev.AddRegion(2); err != nil {
					t.Fatalf("round %d: hotplug: %v", round, err)
				}
				q.SetBufRegion(2)
				if _, err := c.Getattr(vmm.RootID); err != nil {
					t.Fatalf("round %d: a request in the region added just before failed: %v", round, err)
				}
				q.SetBufRegion(1)
				if err := dev.RemoveRegion(2); err != nil {
					t.Fatalf("round %d: unplug: %v", round, err)
				}
			}
		})
	}
}
