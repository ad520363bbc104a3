package passthrough

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"

	gofuse "github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"
)

// TestAllInVariants reruns the whole suite in each variant of the file
// system's fd handling: inodes held by file handle
// (--inode-file-handles=prefer), and held by fd under an fd budget of 16,
// so that nearly every request evicts or reopens (helpers_test.go reads
// the variables).
func TestAllInVariants(t *testing.T) {
	if os.Getenv("PT_FILE_HANDLES") != "" || os.Getenv("PT_FD_BUDGET") != "" {
		t.Skip("already in a variant")
	}
	if testing.Short() {
		t.Skip("short")
	}
	for _, v := range []struct{ name, env string }{
		{"file-handles", "PT_FILE_HANDLES=prefer"},
		{"fd-budget-16", "PT_FD_BUDGET=16"},
	} {
		t.Run(v.name, func(t *testing.T) {
			cmd := exec.Command(os.Args[0], "-test.skip=^TestAllInVariants$", "-test.count=1")
			cmd.Env = append(os.Environ(), v.env)
			if out, err := cmd.CombinedOutput(); err != nil {
				t.Fatalf("suite with %s: %v\n%s", v.env, err, out)
			}
		})
	}
}

func TestFileHandleMode(t *testing.T) {
	tf := newTestFS(t, Options{InodeFileHandles: FileHandlesMandatory})
	if !tf.useHandles {
		t.Fatal("file handles not in use")
	}
	os.WriteFile(tf.path("f"), []byte("abc"), 0o644)
	os.Mkdir(tf.path("d"), 0o755)
	before := tf.Stats().InodeFDs
	var nodes []uint64
	for _, n := range []string{"f", "d"} {
		nodes = append(nodes, tf.lookup(rootID, n).NodeId)
	}
	// Inodes pin no fds beyond the shared mount fd and the directory
	// fd cache's (dircache.go).
	if s := tf.Stats(); s.Inodes != 2 || s.InodeFDs > before+1+int(tf.dirs.fds.Load()) || tf.dirs.fds.Load() > 1 {
		t.Fatalf("stats %+v (before %d, directories cached %d)", s, before, tf.dirs.fds.Load())
	}
	fh := tf.open(nodes[0], unix.O_RDONLY)
	if got := tf.read(nodes[0], fh, 0, 3); string(got) != "abc" {
		t.Fatalf("read %q", got)
	}
	tf.release(nodes[0], fh)
	// An object deleted on the host is stale, and its inode number may
	// be reused without confusing the two.
	os.Remove(tf.path("f"))
	var ao gofuse.AttrOut
	if errno := tf.GetAttr(&gofuse.GetAttrIn{InHeader: *hdr(nodes[0])}, &ao); errno != syscall.ESTALE {
		t.Fatalf("getattr of a deleted file: %v", errno)
	}
	os.WriteFile(tf.path("f"), []byte("new"), 0o644)
	e := tf.lookup(rootID, "f")
	if e.NodeId == nodes[0] {
		t.Fatal("new file got the stale node")
	}
	tf.getattr(e.NodeId)
	if e := tf.lookup(nodes[1], ".."); e.NodeId != rootID {
		t.Fatalf(".. = %d", e.NodeId)
	}
	for _, n := range append(nodes, e.NodeId) {
		tf.Forget(n, 1)
	}
	if s := tf.Stats(); s.Inodes != 0 || s.InodeFDs != tf.baseFDs {
		t.Fatalf("after forget %+v", s)
	}
}

// mountOverlay mounts an overlayfs without nfs_export at dir (whose file
// system then gives no file handles) with one file, or skips the test.
func mountOverlay(t *testing.T, dir string, files ...string) {
	t.Helper()
	base := t.TempDir()
	for _, d := range []string{"lower", "upper", "work"} {
		os.Mkdir(filepath.Join(base, d), 0o755)
	}
	for _, f := range files {
		os.WriteFile(filepath.Join(base, "lower", f), []byte(f), 0o644)
	}
	opts := fmt.Sprintf("lowerdir=%s/lower,upperdir=%s/upper,workdir=%s/work,nfs_export=off,index=off", base, base, base)
	if err := unix.Mount("overlay", dir, "overlay", 0, opts); err != nil {
		t.Skipf("cannot mount an overlayfs here: %v", err)
	}
	t.Cleanup(func() { unix.Unmount(dir, unix.MNT_DETACH) })
}

// A submount whose file system gives no file handles (overlayfs without
// nfs_export) is held by O_PATH fds, decided and logged once for the
// mount; the share's own mount and another submount that gives them keep
// handles.
func TestFileHandlesPerMount(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: open_by_handle_at and mount")
	}
	base := t.TempDir()
	dir := filepath.Join(base, "share")
	os.Mkdir(dir, 0o755)
	for _, d := range []string{"ovl", "tmp"} {
		os.Mkdir(filepath.Join(dir, d), 0o755)
	}
	mountOverlay(t, filepath.Join(dir, "ovl"), "a", "b", "c")
	if err := unix.Mount("tmpfs", filepath.Join(dir, "tmp"), "tmpfs", 0, "size=1m"); err != nil {
		t.Skipf("cannot mount here: %v", err)
	}
	t.Cleanup(func() { unix.Unmount(filepath.Join(dir, "tmp"), unix.MNT_DETACH) })
	os.WriteFile(filepath.Join(dir, "tmp", "x"), nil, 0o644)
	os.WriteFile(filepath.Join(dir, "f"), nil, 0o644)

	log := &countingLog{}
	f, err := New(dir, Options{InodeFileHandles: FileHandlesPrefer}, slog.New(log))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	tf := &testFS{FS: f, t: t, dir: dir, base: base, baseFDs: f.Stats().InodeFDs}
	tf.Init(tf.Capabilities())
	if !tf.useHandles {
		t.Fatal("file handles not in use")
	}
	fds := func() int { return tf.Stats().InodeFDs }
	before := fds()
	tf.lookup(rootID, "f")
	tmp := tf.lookup(rootID, "tmp").NodeId
	tf.lookup(tmp, "x")
	// tmp's mount fd is the only new fd, but for tmp's own, which the
	// directory cache keeps (dircache.go).
	if n := fds(); n != before+2 || tf.dirs.fds.Load() != 1 {
		t.Fatalf("inode fds after lookups on handle mounts: %d, want %d; directories cached %d, want 1", n, before+2, tf.dirs.fds.Load())
	}
	ovl := tf.lookup(rootID, "ovl").NodeId
	for round := 0; round < 2; round++ {
		for _, n := range []string{"a", "b", "c"} {
			tf.lookup(ovl, n)
		}
	}
	// The overlay's directory and its three files: one fd each.
	if n := fds(); n != before+2+4 {
		t.Fatalf("inode fds after lookups on the overlay: %d, want %d", n, before+6)
	}
	if n := log.count("no inode file handles on this mount"); n != 1 {
		t.Fatalf("%d log lines for the overlay mount, want 1: %q", n, log.msgs)
	}
	a := tf.lookup(ovl, "a").NodeId
	fh := tf.open(a, unix.O_RDONLY)
	if got := tf.read(a, fh, 0, 8); string(got) != "a" {
		t.Fatalf("overlay file reads %q", got)
	}
	tf.release(a, fh)

	// mandatory: the overlay's objects are refused.
	m, err := New(dir, Options{InodeFileHandles: FileHandlesMandatory}, testLog)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	m.Init(m.Capabilities())
	var out gofuse.EntryOut
	if errno := m.Lookup(hdr(rootID), []byte("ovl"), &out); errno != syscall.EOPNOTSUPP {
		t.Fatalf("mandatory: lookup on the overlay: %v, want EOPNOTSUPP", errno)
	}
}

// A share whose own file system gives no handles: its inodes are held by
// fds (one log line), a submount that gives them by handle.
func TestFileHandlesShareWithout(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: open_by_handle_at and mount")
	}
	dir := filepath.Join(t.TempDir(), "share")
	os.Mkdir(dir, 0o755)
	mountOverlay(t, dir, "a", "sub")
	os.Remove(filepath.Join(dir, "sub"))
	os.Mkdir(filepath.Join(dir, "sub"), 0o755)
	if err := unix.Mount("tmpfs", filepath.Join(dir, "sub"), "tmpfs", 0, "size=1m"); err != nil {
		t.Skipf("cannot mount here: %v", err)
	}
	t.Cleanup(func() { unix.Unmount(filepath.Join(dir, "sub"), unix.MNT_DETACH) })
	os.WriteFile(filepath.Join(dir, "sub", "x"), nil, 0o644)
	if err := ProbeFileHandles(dir); err == nil || errors.Is(err, ErrHandlesNotPermitted) {
		t.Fatalf("ProbeFileHandles of an overlayfs: %v", err)
	}
	if err := ProbeFileHandles(filepath.Join(dir, "sub")); err != nil {
		t.Fatalf("ProbeFileHandles of a tmpfs: %v", err)
	}
	log := &countingLog{}
	f, err := New(dir, Options{InodeFileHandles: FileHandlesPrefer}, slog.New(log))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	f.Init(f.Capabilities())
	tf := &testFS{FS: f, t: t, dir: dir}
	before := f.Stats().InodeFDs
	tf.lookup(rootID, "a")
	sub := tf.lookup(rootID, "sub").NodeId
	tf.lookup(sub, "x")
	// a's fd, sub's mount fd and sub's own, which the directory cache
	// keeps (dircache.go).
	if n := f.Stats().InodeFDs; n != before+3 || f.dirs.fds.Load() != 1 {
		t.Fatalf("inode fds %d, want %d; directories cached %d, want 1", n, before+3, f.dirs.fds.Load())
	}
	if n := log.count("no inode file handles on this mount"); n != 1 {
		t.Fatalf("%d log lines, want 1: %q", n, log.msgs)
	}
}

// BenchmarkLookupHandles is a LOOKUP of an inode the guest already holds,
// in file handle mode: name_to_handle_at and the mount's decision
// (mountHandles) on each.
func BenchmarkLookupHandles(b *testing.B) {
	if os.Geteuid() != 0 {
		b.Skip("open_by_handle_at needs CAP_DAC_READ_SEARCH")
	}
	dir := b.TempDir()
	os.WriteFile(filepath.Join(dir, "f"), nil, 0o644)
	f, err := New(dir, Options{InodeFileHandles: FileHandlesMandatory}, testLog)
	if err != nil {
		b.Fatal(err)
	}
	defer f.Close()
	f.Init(f.Capabilities())
	var e gofuse.EntryOut
	name := []byte("f")
	b.ReportAllocs()
	for b.Loop() {
		if errno := f.Lookup(hdr(rootID), name, &e); errno != 0 {
			b.Fatal(errno)
		}
	}
}

// A LOOKUP of an inode the guest holds, and a GETATTR, allocate nothing in
// file handle mode either: the handle is encoded on the stack (handleBuf) and copied
// only for a new inode.
func TestLookupHandlesAllocs(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("open_by_handle_at needs CAP_DAC_READ_SEARCH")
	}
	tf := newTestFS(t, Options{InodeFileHandles: FileHandlesMandatory})
	os.WriteFile(tf.path("f"), nil, 0o644)
	os.Mkdir(tf.path("d"), 0o755)
	for _, name := range []string{"f", "d"} {
		first := tf.lookup(rootID, name).NodeId
		var e gofuse.EntryOut
		in, b := hdr(rootID), []byte(name)
		if a := testing.AllocsPerRun(100, func() { tf.Lookup(in, b, &e) }); a != 0 {
			t.Errorf("LOOKUP %s, held: %v allocs", name, a)
		}
		if e.NodeId != first {
			t.Errorf("LOOKUP %s: node %d, then %d", name, first, e.NodeId)
		}
		var ao gofuse.AttrOut
		gin := &gofuse.GetAttrIn{InHeader: *hdr(first)}
		if a := testing.AllocsPerRun(100, func() { tf.GetAttr(gin, &ao) }); a != 0 {
			t.Errorf("GETATTR %s: %v allocs", name, a)
		}
	}
}
