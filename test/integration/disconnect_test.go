package integration

import (
	"fmt"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/govirtiofsd/govirtiofsd/test/vmm"
)

// writer keeps big WRITEs flowing on a ring until stopped.
type writer struct {
	stop      chan struct{}
	done      chan struct{}
	once      sync.Once
	completed atomic.Int64
}

// startWriter starts a writer; it is halted at the latest by a cleanup
// that runs before the device is closed.
func startWriter(c *fsc, dev *vmm.Device, ring int, node, fh uint64, size int) *writer {
	w := &writer{stop: make(chan struct{}), done: make(chan struct{})}
	c.t.Cleanup(w.halt)
	q := dev.Queue(ring)
	data := pattern(ring, size)
	go func() {
		defer close(w.done)
		var calls []*vmm.FuseCall
		for i := 0; ; i++ {
			select {
			case <-w.stop:
				return
			default:
			}
			in := vmm.BuildRequest(c.Header(vmm.OpWrite, node), len(data), vmm.ReadWriteIn(fh, uint64(i%8*size), uint32(len(data)), 0))
			fc, err := q.SubmitFuse(vmm.FuseRequest{In: in, InPages: data, OutArgs: 8})
			if err != nil {
				// Ring full: wait for the oldest.
				if len(calls) == 0 {
					time.Sleep(time.Millisecond)
					continue
				}
				select {
				case <-calls[0].Done():
				case <-w.stop:
					return
				}
				calls = calls[1:]
				continue
			}
			calls = append(calls, fc)
			for len(calls) > 0 {
				select {
				case <-calls[0].Done():
					w.completed.Add(1)
					calls = calls[1:]
					continue
				default:
				}
				break
			}
		}
	}()
	return w
}

func (w *writer) halt() {
	w.once.Do(func() { close(w.stop) })
	<-w.done
}

// TestDisconnectMidRequest: the front end goes away with requests in
// flight (big WRITEs on several rings, some being processed); the daemon
// finishes what it started, exits 0 within two seconds, without a crash or
// a data race.
func TestDisconnectMidRequest(t *testing.T) {
	for _, tc := range []struct {
		name  string
		rings int
		size  int
		after int64 // completions to wait for before disconnecting
		// oneFile: every ring writes the same file, so its inode lock is
		// contended by the servers of several rings.
		oneFile bool
	}{
		{"one-ring-1MiB-writes-at-once", 1, 1 << 20, 0, false},
		{"one-ring-1MiB-writes-streaming", 1, 1 << 20, 3, false},
		{"four-rings-256KiB-writes", 4, 256 << 10, 5, false},
		{"four-rings-1MiB-writes-at-once", 4, 1 << 20, 0, false},
		{"four-rings-one-file-256KiB-writes", 4, 256 << 10, 5, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := startDaemon(t, "--queues", "4")
			o := opts()
			o.Queues, o.QueueSize = 1+tc.rings, 1024
			o.Layout = vmm.SplitLayout(32*vmm.MiB, 256*vmm.MiB)
			dev := d.connect(o)
			c := newFS(t, dev, 1)
			c.mount()
			var ws []*writer
			var node, fh uint64
			for ring := 1; ring <= tc.rings; ring++ {
				if ring == 1 || !tc.oneFile {
					node, fh = c.create(vmm.RootID, fmt.Sprintf("f%d", ring), syscall.O_RDWR)
				}
				ws = append(ws, startWriter(c, dev, ring, node, fh, tc.size))
			}
			deadline := time.Now().Add(opTimeout)
			for ws[0].completed.Load() < tc.after && time.Now().Before(deadline) {
				time.Sleep(time.Millisecond)
			}
			dev.Conn.Close()
			d.checkExit(time.Now())
			for _, w := range ws {
				w.halt()
			}
			var n int64
			for _, w := range ws {
				n += w.completed.Load()
			}
			t.Logf("%d writes completed before the disconnect", n)
		})
	}
}

// TestDisconnectStates: the front end disconnects at various points of
// the device lifecycle; the daemon always exits 0 promptly.
func TestDisconnectStates(t *testing.T) {
	steps := []struct {
		name string
		run  func(t *testing.T, dev *vmm.Device)
	}{
		{"before-any-message", func(t *testing.T, dev *vmm.Device) {}},
		{"after-init", func(t *testing.T, dev *vmm.Device) {
			if err := dev.Init(); err != nil {
				t.Fatal(err)
			}
		}},
		{"running", func(t *testing.T, dev *vmm.Device) {
			if err := dev.Init(); err != nil {
				t.Fatal(err)
			}
			if err := dev.StartRings(); err != nil {
				t.Fatal(err)
			}
			newFS(t, dev, 1).mount()
		}},
		{"rings-stopped", func(t *testing.T, dev *vmm.Device) {
			if err := dev.Init(); err != nil {
				t.Fatal(err)
			}
			if err := dev.StartRings(); err != nil {
				t.Fatal(err)
			}
			newFS(t, dev, 1).mount()
			if _, err := dev.Stop(); err != nil {
				t.Fatal(err)
			}
		}},
		{"rings-disabled-with-pending-chains", func(t *testing.T, dev *vmm.Device) {
			if err := dev.Init(); err != nil {
				t.Fatal(err)
			}
			if err := dev.StartRings(); err != nil {
				t.Fatal(err)
			}
			c := newFS(t, dev, 1)
			c.mount()
			if err := dev.Conn.SetVringEnable(1, false); err != nil {
				t.Fatal(err)
			}
			for range 10 {
				in := vmm.BuildRequest(c.Header(vmm.OpGetattr, vmm.RootID), 0, make([]byte, 16))
				if _, err := dev.Queue(1).SubmitFuse(vmm.FuseRequest{In: in, OutArgs: vmm.FuseAttrOutSize}); err != nil {
					t.Fatal(err)
				}
			}
		}},
		{"half-closed", func(t *testing.T, dev *vmm.Device) {
			if err := dev.Init(); err != nil {
				t.Fatal(err)
			}
			if err := dev.StartRings(); err != nil {
				t.Fatal(err)
			}
			// SHUT_WR: the daemon reads EOF while our end still reads.
			if err := dev.Conn.Shutdown(); err != nil {
				t.Fatal(err)
			}
			if err := dev.Conn.WaitClosed(exitTimeout); err != nil {
				t.Errorf("daemon did not close its end after EOF: %v", err)
			}
		}},
	}
	for _, st := range steps {
		t.Run(st.name, func(t *testing.T) {
			d := startDaemon(t)
			dev := d.dial(opts())
			st.run(t, dev)
			dev.Conn.Close()
			d.checkExit(time.Now())
		})
	}
}

// TestDisconnectDuringStopRestart: the front end vanishes in the middle of
// pause/resume cycles while requests run on two rings.
func TestDisconnectDuringStopRestart(t *testing.T) {
	d := startDaemon(t)
	o := opts()
	o.Queues = 3
	dev := d.connect(o)
	c := newFS(t, dev, 1)
	c.mount()
	node, fh := c.create(vmm.RootID, "f", syscall.O_RDWR)
	w1 := startWriter(c, dev, 1, node, fh, 64<<10)
	w2 := startWriter(c, dev, 2, node, fh, 16<<10)
	var wg sync.WaitGroup
	wg.Go(func() {
		for range 10 {
			base, err := dev.StopQueue(1)
			if err != nil {
				return // disconnected
			}
			if dev.RestartQueue(1, base, false) != nil {
				return
			}
		}
	})
	time.Sleep(20 * time.Millisecond)
	dev.Conn.Close()
	d.checkExit(time.Now())
	wg.Wait()
	w1.halt()
	w2.halt()
}

// TestDisconnectUnreadReply: the front end dies with a reply of the daemon
// still unread in its socket buffer (QEMU killed right after sending a
// request). Closing a socket with unread data makes the kernel send a
// reset, so the daemon's next recvmsg fails with ECONNRESET instead of
// reading EOF. That is a disconnect like any other: exit 0.
func TestDisconnectUnreadReply(t *testing.T) {
	for _, tc := range []struct {
		name string
		req  vmm.Request
	}{
		{"get-features", vmm.GetFeatures},
		{"get-vring-base", vmm.GetVringBase},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := startDaemon(t)
			dev := d.connect(opts())
			newFS(t, dev, 1).mount()
			// Send a request and do not read its reply.
			if err := dev.Conn.Send(tc.req, 0, vmm.VringState{Index: 1}.Bytes(), nil); err != nil {
				t.Fatal(err)
			}
			time.Sleep(200 * time.Millisecond) // the reply is in our receive buffer now
			abort(t, dev.Conn)
			d.checkExit(time.Now())
		})
	}
}

// TestDisconnectBeforeReply: the front end sends a request and goes away
// before the answer: the daemon's reply fails with EPIPE (or ECONNRESET).
// The front end is gone; that is a disconnect: exit 0.
func TestDisconnectBeforeReply(t *testing.T) {
	for _, tc := range []struct {
		name  string
		req   vmm.Request
		flags uint32
		abort bool
	}{
		{"get-features-shutdown", vmm.GetFeatures, 0, false},
		{"get-features-abort", vmm.GetFeatures, 0, true},
		{"get-vring-base", vmm.GetVringBase, 0, false},
		{"set-owner-need-reply", vmm.SetOwner, vmm.FlagNeedReply, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := startDaemon(t)
			dev := d.connect(opts())
			newFS(t, dev, 1).mount()
			if err := dev.Conn.Send(tc.req, tc.flags, vmm.VringState{Index: 1}.Bytes(), nil); err != nil {
				t.Fatal(err)
			}
			if tc.abort {
				abort(t, dev.Conn)
			} else {
				dev.Conn.Close()
			}
			d.checkExit(time.Now())
		})
	}
}
