package integration

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/govirtiofsd/govirtiofsd/test/vmm"
)

// daxOpts is a front end that knows QEMU 11.1's SHMEM.
func daxOpts() vmm.Options {
	o := opts()
	o.Shmem = true
	return o
}

// TestDAXWindowNegotiation: with --cache-size the daemon offers SHMEM
// (and no DEVICE_STATE), answers GET_SHMEM_CONFIG with the window and
// refuses SET_DEVICE_STATE_FD; without it a front end that knows SHMEM
// sees exactly the default offer.
func TestDAXWindowNegotiation(t *testing.T) {
	d := startDaemon(t, "--cache-size", "8M")
	dev := d.connect(daxOpts())
	want := uint64(wantProtocol)&^vmm.Bit(vmm.PDeviceState) | vmm.Bit(vmm.PShmem)
	if dev.OfferedProtocol != want {
		t.Errorf("GET_PROTOCOL_FEATURES with --cache-size = %#x, want %#x", dev.OfferedProtocol, want)
	}
	if dev.Window == nil || dev.Window.Size != 8<<20 || dev.ShmemRegions != 1 {
		t.Fatalf("window %+v in %d regions, want 8 MiB in 1", dev.Window, dev.ShmemRegions)
	}
	var p [2]int
	if err := pipe(p[:]); err != nil {
		t.Fatal(err)
	}
	m, err := dev.Conn.CallFlags(vmm.SetDeviceStateFd, make([]byte, 8), []int{p[1]}, true)
	closeFDs(p[:])
	if err != nil {
		t.Fatal(err)
	}
	if v, _ := m.U64(); v != 1 {
		t.Errorf("SET_DEVICE_STATE_FD with a window answered %d, want 1", v)
	}
	c := newFS(t, dev, 1)
	c.mount()
	c.roundTrip(d, "with-window", pattern(3, 5000))
	noViolations(t, dev)

	d2 := startDaemon(t)
	dev2 := d2.connect(daxOpts())
	if dev2.OfferedProtocol != wantProtocol || dev2.Window != nil {
		t.Errorf("without --cache-size: protocol %#x window %v, want %#x and none", dev2.OfferedProtocol, dev2.Window, uint64(wantProtocol))
	}
}

// TestDAXDirectIOThroughWindow: a guest O_DIRECT read into, and write from,
// a page of its DAX window (a host file the VMM mapped there and announced
// with ADD_MEM_REG) is translated like RAM: the READ's data lands in the
// mapped file, the WRITE's comes from it. After REM_MEM_REG the same
// request is not served from a stale mapping, and the daemon goes on.
func TestDAXDirectIOThroughWindow(t *testing.T) {
	d := startDaemon(t, "--cache-size", "8M")
	dev := d.connect(daxOpts())
	dev.ServeBackend(dev.ServeFSIO)
	data := pattern(4, 8192)
	if err := os.WriteFile(filepath.Join(d.dir, "f"), data, 0o644); err != nil {
		t.Fatal(err)
	}
	mapped, err := os.Create(filepath.Join(t.TempDir(), "mapped"))
	if err != nil {
		t.Fatal(err)
	}
	defer mapped.Close()
	if err := mapped.Truncate(2 << 20); err != nil {
		t.Fatal(err)
	}
	s := vmm.ShmemMsg{ShmOffset: 2 << 20, Len: 2 << 20, Flags: vmm.ShmemWritable}
	if err := dev.MapWindow(s, int(mapped.Fd())); err != nil {
		t.Fatal(err)
	}
	c := newFS(t, dev, 1)
	c.mount()
	node := c.lookup(vmm.RootID, "f").NodeID
	fh := c.open(node, 2) // O_RDWR
	page := dev.Window.Base + 2<<20 + 3*4096

	// READ of the file's second page into the window page.
	body, err := windowCall(c, node, vmm.OpRead, vmm.ReadWriteIn(fh, 4096, 4096, 0), page, true)
	if err != nil {
		t.Fatalf("READ into the window: %v", err)
	}
	got := make([]byte, 4096)
	if _, err := mapped.ReadAt(got, 3*4096); err != nil || !bytes.Equal(got, data[4096:]) || len(body) != 0 {
		t.Errorf("mapped file after READ into the window: %x... (%v), body %d bytes", got[:8], err, len(body))
	}
	// WRITE from the window page (now the file's second page) to the
	// file's first page.
	if _, err := mapped.WriteAt(bytes.Repeat([]byte{0xd5}, 4096), 3*4096); err != nil {
		t.Fatal(err)
	}
	body, err = windowCall(c, node, vmm.OpWrite, vmm.ReadWriteIn(fh, 0, 4096, 0), page, false)
	if err != nil || len(body) < 4 || le.Uint32(body) != 4096 {
		t.Fatalf("WRITE from the window: %x, %v", body, err)
	}
	if b, _ := os.ReadFile(filepath.Join(d.dir, "f")); !bytes.Equal(b[:4096], bytes.Repeat([]byte{0xd5}, 4096)) {
		t.Errorf("file after WRITE from the window: %x...", b[:8])
	}

	// QEMU unmaps: REM_MEM_REG. The page is no longer memory the daemon
	// maps (the VMM's FS_IO cannot reach it either: it is unmapped there
	// too), and the request fails instead of touching a stale mapping.
	if err := dev.UnmapWindow(s); err != nil {
		t.Fatal(err)
	}
	if _, err := windowCall(c, node, vmm.OpRead, vmm.ReadWriteIn(fh, 0, 4096, 0), page, true); err == nil {
		t.Error("READ into an unmapped window page succeeded")
	}
	c.getattr(node)
	noViolations(t, dev)
}

// windowCall sends a READ (reply data into the page at gpa) or WRITE (data
// from it) whose args are args, and returns the reply body.
func windowCall(c *fsc, node uint64, op uint32, args []byte, gpa uint64, toPage bool) ([]byte, error) {
	dataLen := 0
	if !toPage {
		dataLen = 4096
	}
	h := c.Header(op, node)
	in := vmm.BuildRequest(h, dataLen, args)
	mem := c.Dev.Mem
	inGPA, err := mem.Alloc(uint64(len(in)), 8)
	if err != nil {
		return nil, err
	}
	defer mem.Free(inGPA)
	if err := mem.WriteAt(in, inGPA); err != nil {
		return nil, err
	}
	outLen := vmm.FuseOutHeaderSize
	if !toPage {
		outLen += 8 // fuse_write_out
	}
	out, err := mem.Alloc(uint64(outLen), 8)
	if err != nil {
		return nil, err
	}
	defer mem.Free(out)
	segs := []vmm.Segment{{Addr: inGPA, Len: uint32(len(in))}}
	if toPage {
		segs = append(segs, vmm.Segment{Addr: out, Len: uint32(outLen), Write: true}, vmm.Segment{Addr: gpa, Len: 4096, Write: true})
	} else {
		segs = append(segs, vmm.Segment{Addr: gpa, Len: 4096}, vmm.Segment{Addr: out, Len: uint32(outLen), Write: true})
	}
	ch, err := c.Dev.Queue(c.Queue).Submit(segs, vmm.IndirectNever)
	if err != nil {
		return nil, err
	}
	n, err := ch.Wait(opTimeout)
	if err != nil {
		return nil, err
	}
	if n < vmm.FuseOutHeaderSize {
		return nil, fmt.Errorf("used length %d", n)
	}
	reply := make([]byte, outLen)
	if err := mem.ReadAt(reply, out); err != nil {
		return nil, err
	}
	if e := int32(le.Uint32(reply[4:])); e != 0 || le.Uint32(reply) != n {
		return nil, fmt.Errorf("reply error %d, len %d, used %d", e, le.Uint32(reply), n)
	}
	return reply[vmm.FuseOutHeaderSize:], nil
}

func pipe(p []int) error { return unix.Pipe2(p, unix.O_CLOEXEC) }

func closeFDs(fds []int) {
	for _, fd := range fds {
		unix.Close(fd)
	}
}
