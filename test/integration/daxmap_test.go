package integration

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/govirtiofsd/govirtiofsd/test/vmm"
)

const (
	opSetupMapping  = 48
	opRemoveMapping = 49
	daxSlot         = 2 << 20
)

// TestDAXMapFilesOfEverySize: SETUPMAPPING of every 2 MiB slot of files of
// sizes 0 to 2 MiB + 1 through the daemon's window: what the front end's
// window shows is the file, zeros past its end (the tail from a memfd);
// REMOVEMAPPING unmaps; hostile values are refused before the window.
func TestDAXMapFilesOfEverySize(t *testing.T) {
	d := startDaemon(t, "--cache-size", "8M")
	dev := d.connect(daxOpts())
	dev.ServeBackend(dev.ServeWindow)
	sizes := []int{0, 1, 4095, 4096, daxSlot - 1, daxSlot, daxSlot + 1, 3*daxSlot + 7}
	for i, n := range sizes {
		if err := os.WriteFile(filepath.Join(d.dir, "f"+strconv.Itoa(i)), pattern(i, n), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	c := newFS(t, dev, 1)
	o, err := c.Init(vmm.Linux72Minor, vmm.LinuxInitFlags|vmm.InitMapAlignment|vmm.InitHasInodeDax)
	if err != nil {
		t.Fatal(err)
	}
	_ = o
	setup := func(node, fh, foff, length, flags, moff uint64) error {
		_, err := c.Call(opSetupMapping, node, le64(le64(le64(le64(le64(nil, fh), foff), length), flags), moff), nil, 0)
		return err
	}
	remove := func(entries ...uint64) error {
		b := le32(nil, uint32(len(entries)/2))
		for _, v := range entries {
			b = le64(b, v)
		}
		_, err := c.Call(opRemoveMapping, 0, b, nil, 0)
		return err
	}
	for i, n := range sizes {
		e := c.lookup(vmm.RootID, "f"+strconv.Itoa(i))
		c.open(e.NodeID, syscall.O_RDONLY)
		data := pattern(i, n)
		for k := 0; k*daxSlot < n+daxSlot; k++ {
			moff := uint64(k%4) * daxSlot
			if err := setup(e.NodeID, ^uint64(0), uint64(k*daxSlot), daxSlot, 2, moff); err != nil {
				t.Fatalf("size %d slot %d: %v (window: %v)", n, k, err, dev.WindowErrors())
			}
			want := make([]byte, daxSlot)
			if k*daxSlot < n {
				copy(want, data[k*daxSlot:])
			}
			if got := dev.Window.Host()[moff : moff+daxSlot]; !bytes.Equal(got, want) {
				t.Fatalf("size %d slot %d: the window shows other bytes", n, k)
			}
		}
	}
	if len(dev.Window.Mappings()) == 0 {
		t.Fatal("no mappings")
	}
	for _, tc := range []struct {
		name string
		err  error
	}{
		{"past the window", setup(2, ^uint64(0), 0, daxSlot, 2, 8<<20)},
		{"unaligned", setup(2, ^uint64(0), 0, daxSlot, 2, 100)},
		{"unknown node", setup(12345, ^uint64(0), 0, daxSlot, 2, 0)},
		{"bad flags", setup(2, ^uint64(0), 0, daxSlot, 8, 0)},
		{"remove nothing", remove()},
		{"remove past the window", remove(8<<20, daxSlot)},
	} {
		var fe *vmm.FuseError
		if !errors.As(tc.err, &fe) || (fe.Errno != syscall.EINVAL && fe.Errno != syscall.EBADF) {
			t.Errorf("%s: %v", tc.name, tc.err)
		}
	}
	if err := remove(0, daxSlot, daxSlot, daxSlot, 2*daxSlot, 2*daxSlot); err != nil {
		t.Fatal(err)
	}
	if m := dev.Window.Mappings(); len(m) != 0 {
		t.Fatalf("mappings left after REMOVEMAPPING: %+v", m)
	}
	// A host write to a read-mapped small file (all of it in the tail, a
	// copy) reaches the window shortly after: the daemon follows it with
	// inotify, in its sandbox.
	small := c.lookup(vmm.RootID, "f1") // 1 byte
	c.open(small.NodeID, syscall.O_RDONLY)
	if err := setup(small.NodeID, ^uint64(0), 0, daxSlot, 2, 0); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(d.dir, "f1"), []byte("written on the host"), 0o644); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(10 * time.Second); string(dev.Window.Host()[:19]) != "written on the host"; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the window still shows %q after a host write", dev.Window.Host()[:19])
		}
	}
	if err := remove(0, daxSlot); err != nil {
		t.Fatal(err)
	}
	// A writable mapping of a small file: a store in the window's tail
	// reaches the file at FSYNC.
	e := c.lookup(vmm.RootID, "f2") // 4095 bytes
	fh := c.open(e.NodeID, syscall.O_RDWR)
	if err := setup(e.NodeID, ^uint64(0), 0, daxSlot, 3, 0); err != nil {
		t.Fatal(err)
	}
	copy(dev.Window.Host()[100:], "stored in the window")
	if _, err := c.Call(vmm.OpFsync, e.NodeID, le64(le64(nil, fh), 0), nil, 0); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(filepath.Join(d.dir, "f2")); len(b) != 4095 || string(b[100:120]) != "stored in the window" {
		t.Fatalf("the store did not reach the file: %q", b[100:120])
	}
	c.getattr(e.NodeID)
	noViolations(t, dev)
}

// TestDAXInodeFlag: --inode-dax flag marks FUSE_ATTR_DAX on the files whose
// host FS_XFLAG_DAX is set (read with FS_IOC_FSGETXATTR: the sandbox's
// seccomp filter allows that ioctl), all regular files with the default.
func TestDAXInodeFlag(t *testing.T) {
	for _, mode := range []string{"flag", "all"} {
		d := startDaemon(t, "--cache-size", "8M", "--inode-dax", mode)
		dev := d.connect(daxOpts())
		dev.ServeBackend(dev.ServeWindow)
		for _, n := range []string{"plain", "flagged"} {
			if err := os.WriteFile(filepath.Join(d.dir, n), []byte(n), 0o644); err != nil {
				t.Fatal(err)
			}
		}
		fd, err := unix.Open(filepath.Join(d.dir, "flagged"), unix.O_RDONLY, 0)
		if err != nil {
			t.Fatal(err)
		}
		var fsx [28]byte
		_, _, e := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), 0x801c581f, uintptr(unsafe.Pointer(&fsx[0])))
		if e == 0 {
			fsx[1] |= 0x80 // FS_XFLAG_DAX, 0x8000
			_, _, e = unix.Syscall(unix.SYS_IOCTL, uintptr(fd), 0x401c5820, uintptr(unsafe.Pointer(&fsx[0])))
		}
		unix.Close(fd)
		if e != 0 {
			t.Skipf("the share's file system does not take FS_XFLAG_DAX: %v", e)
		}
		c := newFS(t, dev, 1)
		if _, err := c.Init(vmm.Linux72Minor, vmm.LinuxInitFlags|vmm.InitMapAlignment|vmm.InitHasInodeDax); err != nil {
			t.Fatal(err)
		}
		plain := c.lookup(vmm.RootID, "plain").Attr.Flags&2 != 0
		flagged := c.lookup(vmm.RootID, "flagged").Attr.Flags&2 != 0
		if !flagged || plain != (mode == "all") {
			t.Errorf("--inode-dax %s: FUSE_ATTR_DAX on plain %v, on flagged %v", mode, plain, flagged)
		}
		noViolations(t, dev)
	}
}
