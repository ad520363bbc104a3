package integration

// Live migration between two daemons on one shared directory, driven as
// QEMU >= 8.2 drives it (vmm): dirty logging on while the guest runs, the
// rings stopped, the source's state saved through SET_DEVICE_STATE_FD and
// checked, the destination, which never sees an INIT, loading it before
// its rings start. The guest's FUSE session then goes on through the same
// node ids and file handles.

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/govirtiofsd/govirtiofsd/test/vmm"
)

// migOpts is the vmm device as QEMU 10 drives it: DEVICE_STATE acked.
func migOpts() vmm.Options {
	o := opts()
	o.ProtocolFeatures |= vmm.Bit(vmm.PDeviceState)
	return o
}

// saveState is the source's half of a migration: logging on while the
// guest still runs, then the rings stopped and the state saved.
func saveState(t *testing.T, dev *vmm.Device) []byte {
	t.Helper()
	l, err := vmm.NewDirtyLogFor(dev.Mem)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	if err := dev.StartLogging(l); err != nil {
		t.Fatalf("start logging: %v", err)
	}
	if _, err := dev.Stop(); err != nil {
		t.Fatal(err)
	}
	state, err := dev.SaveState()
	if err != nil {
		t.Fatalf("save state: %v", err)
	}
	return state
}

// destination starts a daemon on src's share and a device on it that has
// done QEMU's start-up messages but started no ring (an -incoming VM).
func destination(t *testing.T, src *daemon, extra ...string) (*daemon, *vmm.Device) {
	t.Helper()
	d := startDaemonWith(t, daemonSpec{share: src.dir}, extra...)
	dev := d.dial(migOpts())
	if err := dev.Init(); err != nil {
		t.Fatal(err)
	}
	// Init ends with unanswered SET_VRING_CALL/ERR: be in step with them.
	if _, err := dev.Conn.GetFeatures(); err != nil {
		t.Fatal(err)
	}
	return d, dev
}

// load is the destination's half: the state loaded, then the rings started
// (the VM resumes there), and a client on ring 1 with no INIT.
func load(t *testing.T, dev *vmm.Device, state []byte) *fsc {
	t.Helper()
	if err := dev.LoadState(state); err != nil {
		t.Fatalf("load state: %v", err)
	}
	if err := dev.StartRings(); err != nil {
		t.Fatal(err)
	}
	return newFS(t, dev, 1)
}

// readdir lists directory fh from off with a reply of size bytes and
// returns the names and the offset after the last.
func readdir(c *fsc, node, fh, off uint64, size uint32) ([]string, uint64) {
	c.t.Helper()
	b, err := c.Call(vmm.OpReaddir, node, vmm.ReadWriteIn(fh, off, size, 0), nil, int(size))
	if err != nil {
		c.t.Fatalf("READDIR at %d: %v", off, err)
	}
	var names []string
	for len(b) >= 24 {
		next := le.Uint64(b[8:])
		n := int(le.Uint32(b[16:]))
		if 24+n > len(b) {
			c.t.Fatalf("READDIR: a dirent of %d name bytes in %d", n, len(b))
		}
		names = append(names, string(b[24:24+n]))
		off = next
		b = b[min(len(b), (24+n+7)&^7):]
	}
	return names, off
}

// TestMigrationRoundTrip: a session with files open for reading and for
// appending, a directory listed half-way and a node looked up twice moves
// to a second daemon; there every node id and file handle works as it did
// (same inode numbers), appends land after the old ones, the listing goes
// on where it stopped, FORGET and RELEASE work, and new ids are new.
func TestMigrationRoundTrip(t *testing.T) {
	src := startDaemon(t)
	data := pattern(11, 10000)
	src.writeHostFile("ro", data)
	for _, n := range []string{"d1", "d2", "d3", "d4", "d5", "d6"} {
		src.writeHostFile(n, nil)
	}
	sdev := src.connect(migOpts())
	c := newFS(t, sdev, 1)
	c.mount()
	ro := c.lookup(vmm.RootID, "ro")
	roFH := c.open(ro.NodeID, syscall.O_RDONLY)
	app, appFH := c.create(vmm.RootID, "app", syscall.O_WRONLY|syscall.O_APPEND)
	c.write(app, appFH, 0, []byte("line 1\n"))
	twice := c.lookup(vmm.RootID, "d1")
	c.lookup(vmm.RootID, "d1")
	dirFH := c.opendirRoot()
	first, off := readdir(c, vmm.RootID, dirFH, 0, 160)
	if len(first) == 0 {
		t.Fatal("first READDIR listed nothing")
	}
	before := map[uint64]uint64{}
	for _, n := range []uint64{ro.NodeID, app, twice.NodeID} {
		before[n] = c.getattr(n).Attr.Ino
	}

	state := saveState(t, sdev)
	t.Logf("state: %d bytes", len(state))
	_, ddev := destination(t, src)
	d := load(t, ddev, state)

	for n, ino := range before {
		if got := d.getattr(n).Attr.Ino; got != ino {
			t.Errorf("node %#x: inode %d on the destination, %d on the source", n, got, ino)
		}
	}
	if got := d.read(ro.NodeID, roFH, 0, len(data)); !bytes.Equal(got, data) {
		t.Errorf("READ through the migrated handle: %d bytes, want %d", len(got), len(data))
	}
	d.write(app, appFH, 0, []byte("line 2\n"))
	if got := string(src.hostFile("app")); got != "line 1\nline 2\n" {
		t.Errorf("appended file %q", got)
	}
	rest, _ := readdir(d, vmm.RootID, dirFH, off, 4096)
	seen := map[string]int{}
	for _, n := range append(first, rest...) {
		seen[n]++
	}
	for _, n := range []string{"ro", "app", "d1", "d6"} {
		if seen[n] != 1 {
			t.Errorf("%q listed %d times across the migration (%q then %q)", n, seen[n], first, rest)
		}
	}
	// Two lookups travelled: one FORGET leaves the node usable.
	if err := d.Forget(twice.NodeID, 1); err != nil {
		t.Fatal(err)
	}
	d.getattr(twice.NodeID)
	if err := d.Forget(twice.NodeID, 1); err != nil {
		t.Fatal(err)
	}
	if _, err := d.Getattr(twice.NodeID); !errors.Is(err, syscall.EBADF) {
		t.Errorf("GETATTR after the last FORGET: %v, want EBADF", err)
	}
	// New objects get ids no one holds.
	n2, fh2 := d.create(vmm.RootID, "new", syscall.O_RDWR)
	for _, old := range []uint64{ro.NodeID, app, twice.NodeID, vmm.RootID} {
		if n2 == old {
			t.Errorf("new node id %#x is a migrated one", n2)
		}
	}
	for _, old := range []uint64{roFH, appFH, dirFH} {
		if fh2 == old {
			t.Errorf("new handle %#x is a migrated one", fh2)
		}
	}
	for _, h := range []struct{ node, fh uint64 }{{ro.NodeID, roFH}, {app, appFH}, {n2, fh2}} {
		if err := d.Release(h.node, h.fh, 0); err != nil {
			t.Errorf("RELEASE %#x: %v", h.fh, err)
		}
	}
	noViolations(t, ddev)
}

// TestMigrationNoSession: a guest that has not mounted (or unmounted)
// migrates too; the destination then takes its INIT.
func TestMigrationNoSession(t *testing.T) {
	src := startDaemon(t)
	sdev := src.connect(migOpts())
	state := saveState(t, sdev)
	_, ddev := destination(t, src)
	d := load(t, ddev, state)
	if _, err := d.Getattr(vmm.RootID); err == nil {
		t.Errorf("GETATTR without a session answered")
	}
	d.mount()
	d.roundTrip(src, "after", pattern(3, 5000))
}

// TestMigrationUnlinkedFile: a file the guest holds open is deleted on the
// host before the switch-over: find-paths cannot reopen it. A destination
// with --migration-on-error abort fails the load (the source resumes and
// still serves it); with guest-error the load succeeds, the file's node
// and handle answer ESTALE and the others work.
func TestMigrationUnlinkedFile(t *testing.T) {
	for _, policy := range []string{"abort", "guest-error"} {
		t.Run(policy, func(t *testing.T) {
			src := startDaemon(t)
			src.writeHostFile("gone", []byte("soon deleted"))
			src.writeHostFile("kept", []byte("still here"))
			sdev := src.connect(migOpts())
			c := newFS(t, sdev, 1)
			c.mount()
			gone := c.lookup(vmm.RootID, "gone").NodeID
			goneFH := c.open(gone, syscall.O_RDONLY)
			kept := c.lookup(vmm.RootID, "kept").NodeID
			keptFH := c.open(kept, syscall.O_RDONLY)
			if err := os.Remove(filepath.Join(src.dir, "gone")); err != nil {
				t.Fatal(err)
			}
			state := saveState(t, sdev)
			dst, ddev := destination(t, src, "--migration-on-error", policy)
			if policy == "abort" {
				err := ddev.LoadState(state)
				var re *vmm.ReplyError
				if !errors.As(err, &re) || re.Request != vmm.CheckDeviceState {
					t.Fatalf("load with an unlinked open file: %v, want CHECK_DEVICE_STATE to fail", err)
				}
				// QEMU resumes the VM on the source.
				if err := sdev.Restart(false); err != nil {
					t.Fatal(err)
				}
				if got := string(c.read(gone, goneFH, 0, 64)); got != "soon deleted" {
					t.Errorf("source after the failed migration reads %q", got)
				}
				dst.alive()
				return
			}
			d := load(t, ddev, state)
			if _, err := d.Read(gone, goneFH, 0, 64); !errors.Is(err, syscall.ESTALE) {
				t.Errorf("READ of the unlinked file on the destination: %v, want ESTALE", err)
			}
			if _, err := d.Getattr(gone); !errors.Is(err, syscall.ESTALE) {
				t.Errorf("GETATTR of the unlinked file on the destination: %v, want ESTALE", err)
			}
			if got := string(d.read(kept, keptFH, 0, 64)); got != "still here" {
				t.Errorf("the other file reads %q", got)
			}
			if err := d.Release(gone, goneFH, 0); err != nil {
				t.Errorf("RELEASE of the stale handle: %v", err)
			}
			if err := d.Forget(gone, 1); err != nil {
				t.Fatal(err)
			}
			noViolations(t, ddev)
		})
	}
}

// TestMigrationHostRename: a file renamed on the host after the paths were
// collected (logging on) and before the switch-over is followed with
// --migration-confirm-paths; without it the stale path makes an abort
// destination refuse the state.
func TestMigrationHostRename(t *testing.T) {
	for _, confirm := range []bool{true, false} {
		name := "confirm-paths"
		var extra []string
		if confirm {
			extra = []string{"--migration-confirm-paths"}
		} else {
			name = "collected-paths"
		}
		t.Run(name, func(t *testing.T) {
			src := startDaemon(t, extra...)
			src.writeHostFile("old", []byte("renamed on the host"))
			sdev := src.connect(migOpts())
			c := newFS(t, sdev, 1)
			c.mount()
			node := c.lookup(vmm.RootID, "old").NodeID
			fh := c.open(node, syscall.O_RDONLY)
			l, err := vmm.NewDirtyLogFor(sdev.Mem)
			if err != nil {
				t.Fatal(err)
			}
			defer l.Close()
			if err := sdev.StartLogging(l); err != nil {
				t.Fatal(err)
			}
			c.check() // the guest runs on while the paths are collected
			waitLog(t, src, "paths collected")
			if err := os.Rename(filepath.Join(src.dir, "old"), filepath.Join(src.dir, "new")); err != nil {
				t.Fatal(err)
			}
			if _, err := sdev.Stop(); err != nil {
				t.Fatal(err)
			}
			state, err := sdev.SaveState()
			if err != nil {
				t.Fatal(err)
			}
			_, ddev := destination(t, src)
			if !confirm {
				if err := ddev.LoadState(state); err == nil {
					t.Fatalf("a state with the path from before the rename loaded")
				}
				return
			}
			d := load(t, ddev, state)
			if got := string(d.read(node, fh, 0, 64)); got != "renamed on the host" {
				t.Errorf("READ after the rename reads %q", got)
			}
		})
	}
}

// TestMigrationBadStreams: truncated, garbage and wrong-version streams
// fail CHECK_DEVICE_STATE; the destination keeps no fd of them and then
// loads a good state.
func TestMigrationBadStreams(t *testing.T) {
	src := startDaemon(t)
	src.writeHostFile("f", []byte("x"))
	sdev := src.connect(migOpts())
	c := newFS(t, sdev, 1)
	c.mount()
	node := c.lookup(vmm.RootID, "f").NodeID
	fh := c.open(node, syscall.O_RDONLY)
	state := saveState(t, sdev)
	dst, ddev := destination(t, src)
	before := dst.fdCount()
	wrongVersion := bytes.Clone(state)
	wrongVersion[8]++
	bad := map[string][]byte{
		"empty":         nil,
		"header only":   state[:12],
		"truncated":     state[:len(state)-1],
		"half":          state[:len(state)/2],
		"trailing":      append(bytes.Clone(state), 0),
		"garbage":       bytes.Repeat([]byte{0xa5}, 100000),
		"wrong version": wrongVersion,
	}
	for name, s := range bad {
		err := ddev.LoadState(s)
		var re *vmm.ReplyError
		if !errors.As(err, &re) || re.Request != vmm.CheckDeviceState {
			t.Errorf("%s state: %v, want CHECK_DEVICE_STATE to fail", name, err)
		}
	}
	if after := dst.fdCount(); after > before {
		t.Errorf("destination fds grew from %d to %d across refused states", before, after)
	}
	d := load(t, ddev, state)
	if got := string(d.read(node, fh, 0, 8)); got != "x" {
		t.Errorf("READ after the good load: %q", got)
	}
}

// waitLog waits until the daemon's log holds s.
func waitLog(t *testing.T, d *daemon, s string) {
	t.Helper()
	deadline := time.Now().Add(opTimeout)
	for d.logCount(s) == 0 {
		if time.Now().After(deadline) {
			t.Fatalf("no %q in the daemon log after %v\n%s", s, opTimeout, d.Tail(20))
		}
		time.Sleep(10 * time.Millisecond)
	}
}
