package integration

import (
	"bytes"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/govirtiofsd/govirtiofsd/test/vmm"
)

// bounceOpts: region 2 is a "DAX window": guest memory the front end never
// announces to the daemon, which the VMM side (vmm.ServeFSIO) can reach.
func bounceOpts() vmm.Options {
	o := opts()
	o.Layout = vmm.ContiguousLayout(0, 64*vmm.MiB, 64*vmm.MiB, 16*vmm.MiB)
	o.Hotplug = []int{2}
	o.RingRegion = 0
	o.BufRegion = 1
	return o
}

// call submits a READ or WRITE whose data pages alternate between the given
// regions and returns the reply body and the FUSE error.
func bounceCall(t *testing.T, c *fsc, dev *vmm.Device, op uint32, node, fh, off uint64, data []byte, size int, regions []int) ([]byte, syscall.Errno) {
	t.Helper()
	h := c.Session.Header(op, node)
	var in []byte
	r := vmm.FuseRequest{DataRegions: regions, Indirect: vmm.IndirectAlways}
	if op == vmm.OpWrite {
		in = vmm.BuildRequest(h, len(data), vmm.ReadWriteIn(fh, off, uint32(len(data)), 0))
		r.InPages, r.OutArgs = data, 8
	} else {
		in = vmm.BuildRequest(h, 0, vmm.ReadWriteIn(fh, off, uint32(size), 0))
		r.OutPages = size
	}
	r.In = in
	call, err := dev.Queue(c.Session.Queue).SubmitFuse(r)
	if err != nil {
		t.Fatal(err)
	}
	reply, err := call.Wait(10 * time.Second)
	if err != nil {
		t.Fatal(err)
	}
	oh, body, err := vmm.ParseReply(reply)
	if err != nil {
		t.Fatal(err)
	}
	return body, syscall.Errno(-oh.Error)
}

// TestBounceThroughVMM: WRITE and READ data pages outside every region the
// daemon mapped travel through FS_IO requests that the VMM performs, mixed
// with mapped pages in the same request, in both directions, data checked.
func TestBounceThroughVMM(t *testing.T) {
	d := startDaemon(t)
	dev := d.connect(bounceOpts())
	var served atomic.Int64
	dev.ServeBackend(func(m *vmm.Message) uint64 {
		served.Add(1)
		return dev.ServeFSIO(m)
	})
	c := newFS(t, dev, 1)
	c.mount()
	node, fh := c.create(vmm.RootID, "bounced", syscall.O_RDWR)
	for _, tc := range []struct {
		name    string
		regions []int
		size    int
	}{
		{"all-unmapped", []int{2}, 64 << 10},
		{"mixed", []int{1, 2}, 256 << 10},
		{"mixed-runs", []int{2, 2, 2, 1, 2, 2, 2, 2, 2, 2, 2, 2, 1}, 480 << 10},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := served.Load()
			data := pattern(len(tc.name), tc.size)
			body, errno := bounceCall(t, c, dev, vmm.OpWrite, node, fh, 0, data, 0, tc.regions)
			if errno != 0 || len(body) != 8 || le.Uint32(body) != uint32(tc.size) {
				t.Fatalf("write: errno %v, body %x", errno, body)
			}
			if got := d.hostFile("bounced")[:tc.size]; !bytes.Equal(got, data) {
				t.Fatalf("host file differs at %d", firstDiff(got, data))
			}
			body, errno = bounceCall(t, c, dev, vmm.OpRead, node, fh, 0, nil, tc.size, tc.regions)
			if errno != 0 || !bytes.Equal(body, data) {
				t.Fatalf("read: errno %v, %d bytes, differs at %d", errno, len(body), firstDiff(body, data))
			}
			if served.Load() == before {
				t.Fatal("no FS_IO request reached the VMM")
			}
		})
	}
	// A read past end of file is clamped before it is sent: the VMM is
	// asked for exactly the bytes that exist.
	body, errno := bounceCall(t, c, dev, vmm.OpRead, node, fh, (480<<10)-100, nil, 8192, []int{2})
	if errno != 0 || len(body) != 100 {
		t.Fatalf("read at EOF: errno %v, %d bytes", errno, len(body))
	}
	c.roundTrip(d, "after-bounce", pattern(7, 12345))
}

// TestBounceRefused: a VMM that does not implement FS_IO (QEMU 7.2 answers
// an unknown back-end request with 1) fails the request with EFAULT; the
// daemon keeps serving.
func TestBounceRefused(t *testing.T) {
	d := startDaemon(t)
	dev := d.connect(bounceOpts())
	dev.ServeBackend(nil) // answers 1 to everything
	c := newFS(t, dev, 1)
	c.mount()
	node, fh := c.create(vmm.RootID, "f", syscall.O_RDWR)
	if _, errno := bounceCall(t, c, dev, vmm.OpWrite, node, fh, 0, pattern(1, 8192), 0, []int{2}); errno != syscall.EFAULT {
		t.Fatalf("write through a refusing VMM: %v, want EFAULT", errno)
	}
	if _, errno := bounceCall(t, c, dev, vmm.OpRead, node, fh, 0, nil, 8192, []int{2}); errno != 0 && errno != syscall.EFAULT {
		t.Fatalf("read through a refusing VMM: %v", errno)
	}
	c.roundTrip(d, "after-refusal", pattern(3, 5000))
}

// TestBounceStopWhileWaiting: the VMM never answers FS_IO (its main loop is
// busy, as QEMU's is while it waits for GET_VRING_BASE). Stopping the ring
// must not wait for the VMM: the request fails with EIO, GET_VRING_BASE
// answers, and after a restart the late reply is discarded and requests
// are served again.
func TestBounceStopWhileWaiting(t *testing.T) {
	d := startDaemon(t)
	dev := d.connect(bounceOpts())
	c := newFS(t, dev, 1)
	c.mount()
	node, fh := c.create(vmm.RootID, "f", syscall.O_RDWR)

	// Take the back-end channel's requests without answering them.
	pending := make(chan *vmm.Message, 4)
	go func() {
		for {
			m, err := dev.Backend.RecvTimeout(-1)
			if err != nil {
				return
			}
			pending <- m
		}
	}()
	h := c.Session.Header(vmm.OpWrite, node)
	data := pattern(9, 16384)
	call, err := dev.Queue(1).SubmitFuse(vmm.FuseRequest{
		In:      vmm.BuildRequest(h, len(data), vmm.ReadWriteIn(fh, 0, uint32(len(data)), 0)),
		InPages: data, OutArgs: 8, DataRegions: []int{2}, Indirect: vmm.IndirectAlways,
	})
	if err != nil {
		t.Fatal(err)
	}
	var m *vmm.Message
	select {
	case m = <-pending:
	case <-time.After(10 * time.Second):
		t.Fatal("no FS_IO request")
	}
	start := time.Now()
	base, err := dev.StopQueue(1)
	if err != nil {
		t.Fatalf("GET_VRING_BASE while a request waits for the VMM: %v", err)
	}
	if el := time.Since(start); el > 3*time.Second {
		t.Errorf("GET_VRING_BASE took %v", el)
	}
	reply, err := call.Wait(5 * time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if oh, _, err := vmm.ParseReply(reply); err != nil || oh.Error != -int32(syscall.EIO) {
		t.Fatalf("cancelled request: %+v %v, want EIO", oh, err)
	}
	// The VMM answers late (and did the I/O after all).
	dev.ServeFSIO(m)
	if err := dev.Backend.Reply(m, vmm.U64(16384)); err != nil {
		t.Fatal(err)
	}
	m.CloseFds()
	if err := dev.RestartQueue(1, base, false); err != nil {
		t.Fatal(err)
	}
	// The next bounce reads and drops the stale reply first.
	go func() {
		for m := range pending {
			v := dev.ServeFSIO(m)
			m.CloseFds()
			dev.Backend.Reply(m, vmm.U64(v))
		}
	}()
	body, errno := bounceCall(t, c, dev, vmm.OpWrite, node, fh, 0, data, 0, []int{1, 2})
	if errno != 0 || le.Uint32(body) != uint32(len(data)) {
		t.Fatalf("write after the stop: %v %x", errno, body)
	}
	c.roundTrip(d, "after-stop", pattern(4, 3000))
}
