package passthrough

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	gofuse "github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"
)

func TestLookupGetAttrForget(t *testing.T) {
	tf := newTestFS(t, Options{})
	os.WriteFile(tf.path("f"), []byte("hello"), 0o644)
	os.Mkdir(tf.path("d"), 0o755)
	host := statHost(t, tf.path("f"))

	e := tf.lookup(rootID, "f")
	if e.NodeId == rootID || e.NodeId == 0 || e.Ino != host.Ino || e.Size != 5 || e.Mode&unix.S_IFMT != unix.S_IFREG {
		t.Fatalf("entry %+v", e)
	}
	if e.EntryValid != 1 || e.AttrValid != 1 {
		t.Errorf("auto timeouts = %d/%d, want 1/1", e.EntryValid, e.AttrValid)
	}
	e2 := tf.lookup(rootID, "f")
	if e2.NodeId != e.NodeId {
		t.Fatalf("second lookup gave node %d, want %d", e2.NodeId, e.NodeId)
	}
	a := tf.getattr(e.NodeId)
	if a.Ino != host.Ino || a.Size != 5 {
		t.Fatalf("getattr %+v", a)
	}
	if errno := tf.lookupErr(rootID, "missing"); errno != syscall.ENOENT {
		t.Fatalf("missing: %v", errno)
	}
	if errno := tf.lookupErr(e.NodeId, "x"); errno != syscall.ENOTDIR {
		t.Fatalf("lookup in file: %v", errno)
	}
	if s := tf.Stats(); s.Inodes != 1 {
		t.Fatalf("stats %+v", s)
	}
	tf.Forget(e.NodeId, 1)
	tf.getattr(e.NodeId)   // one lookup left
	tf.Forget(e.NodeId, 5) // more than held: clamps
	var out gofuse.AttrOut
	if errno := tf.GetAttr(&gofuse.GetAttrIn{InHeader: *hdr(e.NodeId)}, &out); errno != syscall.EBADF {
		t.Fatalf("getattr after forget: %v", errno)
	}
	if s := tf.Stats(); s.Inodes != 0 || s.InodeFDs != tf.baseFDs {
		t.Fatalf("stats after forget %+v", s)
	}
	// A new lookup gets a new id (generation changes).
	e3 := tf.lookup(rootID, "f")
	if e3.NodeId == e.NodeId {
		t.Fatalf("node id reused after forget: %#x", e3.NodeId)
	}
	tf.Forget(rootID, 100) // the root is never freed
	tf.getattr(rootID)
}

func TestStaleAndBogusIDs(t *testing.T) {
	tf := newTestFS(t, Options{Xattr: true, PosixLocks: true})
	os.WriteFile(tf.path("f"), []byte("x"), 0o644)
	e := tf.lookup(rootID, "f")
	fh := tf.open(e.NodeId, unix.O_RDONLY)
	bogus := []uint64{0, 2, 3, e.NodeId + 1, e.NodeId ^ 1<<40, ^uint64(0), 1 << 32, uint64(maxSlots) + 5, fh, fh + 1}
	for _, id := range bogus {
		var ao gofuse.AttrOut
		if id != e.NodeId {
			if errno := tf.GetAttr(&gofuse.GetAttrIn{InHeader: *hdr(id)}, &ao); errno != syscall.EBADF {
				t.Errorf("getattr %#x: %v", id, errno)
			}
			var eo gofuse.EntryOut
			if errno := tf.Lookup(hdr(id), []byte("f"), &eo); errno != syscall.EBADF {
				t.Errorf("lookup in %#x: %v", id, errno)
			}
			tf.Forget(id, 1)
		}
		if id != fh {
			buf := make([]byte, 10)
			if _, errno := tf.Read(&gofuse.ReadIn{InHeader: *hdr(e.NodeId), Fh: id, Size: 10}, vecOver(buf)); errno != syscall.EBADF {
				t.Errorf("read fh %#x: %v", id, errno)
			}
			tf.Release(&gofuse.ReleaseIn{InHeader: *hdr(e.NodeId), Fh: id})
			tf.ReleaseDir(&gofuse.ReleaseIn{InHeader: *hdr(e.NodeId), Fh: id})
		}
	}
	// A file handle is not a directory handle, and a handle belongs to
	// its node.
	if errno := tf.ReadDir(&gofuse.ReadIn{InHeader: *hdr(e.NodeId), Fh: fh}, false, nil); errno != syscall.EBADF {
		t.Errorf("readdir on file handle: %v", errno)
	}
	buf := make([]byte, 1)
	if _, errno := tf.Read(&gofuse.ReadIn{InHeader: *hdr(rootID), Fh: fh, Size: 1}, vecOver(buf)); errno != syscall.EBADF {
		t.Errorf("read with handle of another node: %v", errno)
	}
	if got := tf.read(e.NodeId, fh, 0, 1); string(got) != "x" {
		t.Fatalf("read %q", got)
	}
	tf.release(e.NodeId, fh)
	tf.release(e.NodeId, fh) // double release is ignored
	if _, errno := tf.Read(&gofuse.ReadIn{InHeader: *hdr(e.NodeId), Fh: fh, Size: 1}, vecOver(buf)); errno != syscall.EBADF {
		t.Errorf("read after release: %v", errno)
	}
}

func TestNameValidation(t *testing.T) {
	tf := newTestFS(t, Options{})
	os.Mkdir(tf.path("sub"), 0o755)
	os.WriteFile(filepath.Join(tf.base, "outside"), []byte("secret"), 0o644)
	long := strings.Repeat("a", 256)
	bad := map[string]syscall.Errno{
		"":           syscall.EINVAL,
		"a/b":        syscall.EINVAL,
		"/etc":       syscall.EINVAL,
		"../outside": syscall.EINVAL,
		"a\x00b":     syscall.EINVAL,
		long:         syscall.ENAMETOOLONG,
	}
	for name, want := range bad {
		if errno := tf.lookupErr(rootID, name); errno != want {
			t.Errorf("lookup %q: %v, want %v", name, errno, want)
		}
		var eo gofuse.EntryOut
		if errno := tf.Mkdir(&gofuse.MkdirIn{InHeader: *hdr(rootID), Mode: 0o755}, noGroup, nil, []byte(name), &eo); errno != want {
			t.Errorf("mkdir %q: %v, want %v", name, errno, want)
		}
		var co gofuse.CreateOut
		if errno := tf.Create(&gofuse.CreateIn{InHeader: *hdr(rootID), Flags: unix.O_RDWR, Mode: 0o644}, noGroup, nil, []byte(name), &co); errno != want {
			t.Errorf("create %q: %v, want %v", name, errno, want)
		}
		if errno := tf.Unlink(hdr(rootID), []byte(name)); errno != want {
			t.Errorf("unlink %q: %v, want %v", name, errno, want)
		}
		if errno := tf.Rename(hdr(rootID), rootID, 0, []byte("sub"), []byte(name)); errno != want {
			t.Errorf("rename to %q: %v, want %v", name, errno, want)
		}
	}
	if errno := tf.lookupErr(rootID, strings.Repeat("b", 255)); errno != syscall.ENOENT {
		t.Errorf("255-byte name: %v", errno)
	}
	// "." and ".." are refused where they would name something else.
	for _, name := range []string{".", ".."} {
		var eo gofuse.EntryOut
		if errno := tf.Mkdir(&gofuse.MkdirIn{InHeader: *hdr(rootID), Mode: 0o755}, noGroup, nil, []byte(name), &eo); errno != syscall.EINVAL {
			t.Errorf("mkdir %q: %v", name, errno)
		}
		if errno := tf.Rmdir(hdr(rootID), []byte(name)); errno != syscall.EINVAL {
			t.Errorf("rmdir %q: %v", name, errno)
		}
		if errno := tf.Rename(hdr(rootID), rootID, 0, []byte(name), []byte("x")); errno != syscall.EINVAL {
			t.Errorf("rename %q: %v", name, errno)
		}
		var lo gofuse.EntryOut
		if errno := tf.Link(&gofuse.LinkIn{InHeader: *hdr(rootID), Oldnodeid: rootID}, []byte(name), &lo); errno != syscall.EINVAL {
			t.Errorf("link %q: %v", name, errno)
		}
	}
	// LOOKUP of "." and ".." at the root is the root.
	for _, name := range []string{".", ".."} {
		if e := tf.lookup(rootID, name); e.NodeId != rootID {
			t.Errorf("lookup %q at root: node %d", name, e.NodeId)
		}
	}
	sub := tf.lookup(rootID, "sub")
	if e := tf.lookup(sub.NodeId, "."); e.NodeId != sub.NodeId {
		t.Errorf(". in sub: %d, want %d", e.NodeId, sub.NodeId)
	}
	if e := tf.lookup(sub.NodeId, ".."); e.NodeId != rootID {
		t.Errorf(".. in sub: %d, want root", e.NodeId)
	}
	if s := tf.Stats(); s.Inodes != 1 {
		t.Errorf("stats %+v", s)
	}
}

// A host-side rename moves a looked-up directory out of the share: ".."
// must not climb above the root.
func TestDotDotAfterHostMove(t *testing.T) {
	tf := newTestFS(t, Options{})
	os.MkdirAll(tf.path("a/b"), 0o755)
	a := tf.lookup(rootID, "a")
	b := tf.lookup(a.NodeId, "b")
	if e := tf.lookup(b.NodeId, ".."); e.NodeId != a.NodeId {
		t.Fatalf(".. of b = %d, want %d", e.NodeId, a.NodeId)
	}
	if err := os.Rename(tf.path("a"), filepath.Join(tf.base, "moved")); err != nil {
		t.Fatal(err)
	}
	if errno := tf.lookupErr(b.NodeId, ".."); errno != syscall.EACCES {
		t.Fatalf(".. of a dir moved out of the share: %v", errno)
	}
	if errno := tf.lookupErr(a.NodeId, ".."); errno != syscall.EACCES {
		t.Fatalf(".. of the moved dir: %v", errno)
	}
}

func TestSymlinkIsNotFollowed(t *testing.T) {
	tf := newTestFS(t, Options{Xattr: true})
	outside := filepath.Join(tf.base, "outside")
	os.Mkdir(outside, 0o755)
	os.WriteFile(filepath.Join(outside, "secret"), []byte("secret"), 0o644)
	os.Symlink(outside, tf.path("abs"))
	os.Symlink("../outside", tf.path("rel"))
	os.Symlink("/proc/self/root", tf.path("magic"))
	outSt := statHost(t, outside)
	for _, name := range []string{"abs", "rel", "magic"} {
		e := tf.lookup(rootID, name)
		if e.Mode&unix.S_IFMT != unix.S_IFLNK || e.Ino == outSt.Ino {
			t.Fatalf("%s: lookup gave mode %o ino %d (outside is %d)", name, e.Mode, e.Ino, outSt.Ino)
		}
		if errno := tf.lookupErr(e.NodeId, "secret"); errno != syscall.ENOTDIR {
			t.Errorf("%s/secret: %v", name, errno)
		}
		var oo gofuse.OpenOut
		if errno := tf.Open(&gofuse.OpenIn{InHeader: *hdr(e.NodeId), Flags: unix.O_RDONLY}, &oo); errno != syscall.EBADF {
			t.Errorf("open symlink %s: %v", name, errno)
		}
		if errno := tf.OpenDir(&gofuse.OpenIn{InHeader: *hdr(e.NodeId)}, &oo); errno != syscall.ENOTDIR {
			t.Errorf("opendir symlink %s: %v", name, errno)
		}
		buf := make([]byte, 4096)
		n, errno := tf.Readlink(hdr(e.NodeId), buf)
		want, _ := os.Readlink(tf.path(name))
		if errno != 0 || string(buf[:n]) != want {
			t.Errorf("readlink %s: %q %v", name, buf[:n], errno)
		}
		// Attribute changes act on the link, never on its target.
		var ao gofuse.AttrOut
		if errno := tf.SetAttr(&gofuse.SetAttrIn{SetAttrInCommon: gofuse.SetAttrInCommon{InHeader: *hdr(e.NodeId), Valid: gofuse.FATTR_MODE, Mode: 0o777}}, &ao); errno != syscall.EOPNOTSUPP {
			t.Errorf("chmod symlink: %v", errno)
		}
		sia := gofuse.SetAttrIn{SetAttrInCommon: gofuse.SetAttrInCommon{InHeader: *hdr(e.NodeId), Valid: gofuse.FATTR_UID | gofuse.FATTR_GID}}
		sia.Uid, sia.Gid = 1234, 1234
		if errno := tf.SetAttr(&sia, &ao); errno != 0 {
			t.Errorf("lchown: %v", errno)
		}
		if st := statHost(t, outside); st.Uid != 0 || st.Mode&0o777 != 0o755 {
			t.Fatalf("target changed through %s: %+v", name, st)
		}
		if st := statHost(t, tf.path(name)); st.Uid != 1234 {
			t.Errorf("lchown did not change the link: uid %d", st.Uid)
		}
		// xattrs of a symlink are the link's.
		var xbuf [64]byte
		if _, errno := tf.GetXAttr(hdr(e.NodeId), []byte("trusted.t"), xbuf[:]); errno != syscall.ENODATA {
			t.Errorf("getxattr symlink %s: %v", name, errno)
		}
	}
	// The target's xattr is never reachable through the link.
	unix.Setxattr(outside, "trusted.t", []byte("outside"), 0)
	e := tf.lookup(rootID, "abs")
	if errno := tf.SetXAttr(&gofuse.SetXAttrIn{InHeader: *hdr(e.NodeId)}, []byte("trusted.t"), []byte("link")); errno != 0 {
		t.Fatalf("setxattr on symlink: %v", errno)
	}
	var xb [64]byte
	n, _ := unix.Getxattr(outside, "trusted.t", xb[:])
	if string(xb[:n]) != "outside" {
		t.Fatalf("target xattr changed: %q", xb[:n])
	}
	n, errno := tf.GetXAttr(hdr(e.NodeId), []byte("trusted.t"), xb[:])
	if errno != 0 || string(xb[:n]) != "link" {
		t.Fatalf("getxattr symlink: %q %v", xb[:n], errno)
	}
}

// A host process swaps a directory and a symlink to outside the share while
// the guest looks names up below it: nothing outside may ever resolve.
func TestHostSwapRace(t *testing.T) {
	tf := newTestFS(t, Options{})
	outside := filepath.Join(tf.base, "outside")
	os.Mkdir(outside, 0o755)
	os.WriteFile(filepath.Join(outside, "secret"), []byte("secret"), 0o644)
	os.Mkdir(tf.path("d"), 0o755)
	os.Symlink(outside, tf.path("l"))
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			select {
			case <-stop:
				return
			default:
			}
			unix.Renameat2(unix.AT_FDCWD, tf.path("d"), unix.AT_FDCWD, tf.path("l"), unix.RENAME_EXCHANGE)
		}
	}()
	deadline := time.Now().Add(500 * time.Millisecond)
	tries := 0
	for time.Now().Before(deadline) {
		tries++
		var d gofuse.EntryOut
		if errno := tf.Lookup(hdr(rootID), []byte("d"), &d); errno != 0 {
			continue
		}
		var s gofuse.EntryOut
		if errno := tf.Lookup(hdr(d.NodeId), []byte("secret"), &s); errno == 0 {
			close(stop)
			t.Fatalf("resolved a file outside the share (mode %o)", s.Mode)
		}
		var fh gofuse.OpenOut
		if tf.OpenDir(&gofuse.OpenIn{InHeader: *hdr(d.NodeId)}, &fh) == 0 {
			names := tf.readdirAll(d.NodeId, false, 100)
			for _, n := range names {
				if n.name == "secret" {
					close(stop)
					t.Fatal("listed a directory outside the share")
				}
			}
			tf.ReleaseDir(&gofuse.ReleaseIn{InHeader: *hdr(d.NodeId), Fh: fh.Fh})
		}
		tf.Forget(d.NodeId, 1)
	}
	close(stop)
	<-done
	t.Logf("%d lookups", tries)
}

func TestCreateOpenReadWrite(t *testing.T) {
	tf := newTestFS(t, Options{})
	c := tf.create(rootID, "f", unix.O_RDWR, 0o640)
	if c.Mode != unix.S_IFREG|0o640 || c.OpenOut.Fh == 0 {
		t.Fatalf("create: %+v", c)
	}
	if n := tf.write(c.NodeId, c.Fh, 0, []byte("hello world"), 0); n != 11 {
		t.Fatalf("wrote %d", n)
	}
	if got := tf.read(c.NodeId, c.Fh, 6, 100); string(got) != "world" {
		t.Fatalf("read %q", got)
	}
	if errno := tf.Flush(&gofuse.FlushIn{InHeader: *hdr(c.NodeId), Fh: c.Fh}); errno != 0 {
		t.Fatal(errno)
	}
	if errno := tf.Fsync(&gofuse.FsyncIn{InHeader: *hdr(c.NodeId), Fh: c.Fh, FsyncFlags: 1}); errno != 0 {
		t.Fatal(errno)
	}
	tf.release(c.NodeId, c.Fh)
	if b, _ := os.ReadFile(tf.path("f")); string(b) != "hello world" {
		t.Fatalf("host content %q", b)
	}
	// O_EXCL on an existing name.
	var co gofuse.CreateOut
	if errno := tf.Create(&gofuse.CreateIn{InHeader: *hdr(rootID), Flags: unix.O_RDWR | unix.O_EXCL, Mode: 0o644}, noGroup, nil, []byte("f"), &co); errno != syscall.EEXIST {
		t.Fatalf("create O_EXCL existing: %v", errno)
	}
	// Without O_EXCL the existing file is opened (and truncated).
	c2 := tf.create(rootID, "f", unix.O_RDWR|unix.O_TRUNC, 0o644)
	if c2.NodeId != c.NodeId || c2.Size != 0 {
		t.Fatalf("create existing: %+v", c2)
	}
	tf.release(c2.NodeId, c2.Fh)
	if b, _ := os.ReadFile(tf.path("f")); len(b) != 0 {
		t.Fatalf("not truncated: %q", b)
	}
	// OPEN with O_TRUNC and O_APPEND.
	os.WriteFile(tf.path("f"), []byte("abc"), 0o644)
	fh := tf.open(c.NodeId, unix.O_WRONLY|unix.O_APPEND)
	tf.write(c.NodeId, fh, 0, []byte("def"), 0)
	tf.release(c.NodeId, fh)
	if b, _ := os.ReadFile(tf.path("f")); string(b) != "abcdef" {
		t.Fatalf("append: %q", b)
	}
	fh = tf.open(c.NodeId, unix.O_WRONLY|unix.O_TRUNC)
	tf.release(c.NodeId, fh)
	if st := statHost(t, tf.path("f")); st.Size != 0 {
		t.Fatalf("O_TRUNC: size %d", st.Size)
	}
	if s := tf.Stats(); s.Handles != 0 || s.HandleFDs != 0 {
		t.Fatalf("stats %+v", s)
	}
}

func TestOpenFlagsPerCacheMode(t *testing.T) {
	for _, tc := range []struct {
		mode      CacheMode
		timeout   uint64
		file, dir uint32
	}{
		{CacheNever, 0, gofuse.FOPEN_DIRECT_IO, 0},
		{CacheMetadata, 86400, gofuse.FOPEN_DIRECT_IO, 0},
		{CacheAuto, 1, 0, 0},
		{CacheAlways, 86400, gofuse.FOPEN_KEEP_CACHE, gofuse.FOPEN_KEEP_CACHE | gofuse.FOPEN_CACHE_DIR},
	} {
		t.Run(tc.mode.String(), func(t *testing.T) {
			tf := newTestFS(t, Options{Cache: tc.mode})
			os.WriteFile(tf.path("f"), nil, 0o644)
			e := tf.lookup(rootID, "f")
			if e.EntryValid != tc.timeout || e.AttrValid != tc.timeout {
				t.Errorf("timeouts %d/%d", e.EntryValid, e.AttrValid)
			}
			var oo gofuse.OpenOut
			tf.Open(&gofuse.OpenIn{InHeader: *hdr(e.NodeId)}, &oo)
			if oo.OpenFlags != tc.file {
				t.Errorf("file open flags %#x", oo.OpenFlags)
			}
			tf.OpenDir(&gofuse.OpenIn{InHeader: *hdr(rootID)}, &oo)
			if oo.OpenFlags != tc.dir {
				t.Errorf("dir open flags %#x", oo.OpenFlags)
			}
		})
	}
}

func TestWritebackOpenFlags(t *testing.T) {
	tf := newTestFS(t, Options{Writeback: true})
	if tf.Capabilities()&gofuse.CAP_WRITEBACK_CACHE == 0 {
		t.Fatal("no writeback cap")
	}
	os.WriteFile(tf.path("f"), []byte("abc"), 0o644)
	e := tf.lookup(rootID, "f")
	// O_WRONLY becomes O_RDWR (the kernel reads through it) and O_APPEND
	// is dropped (the kernel sends the offsets).
	fh := tf.open(e.NodeId, unix.O_WRONLY|unix.O_APPEND)
	if got := tf.read(e.NodeId, fh, 0, 3); string(got) != "abc" {
		t.Fatalf("read through write-only open: %q", got)
	}
	tf.write(e.NodeId, fh, 1, []byte("X"), 0)
	tf.release(e.NodeId, fh)
	if b, _ := os.ReadFile(tf.path("f")); string(b) != "aXc" {
		t.Fatalf("content %q", b)
	}
}

func TestDirectIOFlag(t *testing.T) {
	for _, allow := range []bool{false, true} {
		tf := newTestFS(t, Options{AllowDirectIO: allow})
		os.WriteFile(tf.path("f"), nil, 0o644)
		e := tf.lookup(rootID, "f")
		fh := tf.open(e.NodeId, unix.O_RDONLY|unix.O_DIRECT)
		h := tf.handles.get(fh)
		fl, _ := unix.FcntlInt(uintptr(h.fd), unix.F_GETFL, 0)
		if got := fl&unix.O_DIRECT != 0; got != allow {
			t.Errorf("allow_direct_io=%v: host O_DIRECT=%v", allow, got)
		}
		tf.release(e.NodeId, fh)
	}
}

// CVE-2020-35517: special files made with MKNOD must never be opened.
func TestMknodSpecialFilesAreNotOpened(t *testing.T) {
	tf := newTestFS(t, Options{})
	specials := []struct {
		name string
		mode uint32
		rdev uint32
	}{
		{"fifo", unix.S_IFIFO | 0o666, 0},
		{"null", unix.S_IFCHR | 0o666, newEncodeDev(1, 3)},
		{"sock", unix.S_IFSOCK | 0o666, 0},
	}
	for _, s := range specials {
		var e gofuse.EntryOut
		if errno := tf.Mknod(&gofuse.MknodIn{InHeader: *hdr(rootID), Mode: s.mode, Rdev: s.rdev}, noGroup, nil, []byte(s.name), &e); errno != 0 {
			t.Fatalf("mknod %s: %v", s.name, errno)
		}
		if e.Mode != s.mode || e.Rdev != s.rdev {
			t.Errorf("%s: mode %o rdev %#x", s.name, e.Mode, e.Rdev)
		}
		done := make(chan syscall.Errno, 1)
		go func() {
			var oo gofuse.OpenOut
			done <- tf.Open(&gofuse.OpenIn{InHeader: *hdr(e.NodeId), Flags: unix.O_RDWR}, &oo)
		}()
		select {
		case errno := <-done:
			if errno != syscall.EBADF {
				t.Errorf("open %s: %v", s.name, errno)
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("open %s blocked", s.name)
		}
		// CREATE without O_EXCL of the existing name must not open it either.
		var co gofuse.CreateOut
		if errno := tf.Create(&gofuse.CreateIn{InHeader: *hdr(rootID), Flags: unix.O_RDONLY, Mode: 0o644}, noGroup, nil, []byte(s.name), &co); errno != syscall.EBADF {
			t.Errorf("create over %s: %v", s.name, errno)
		}
		var ao gofuse.AttrOut
		if errno := tf.SetAttr(&gofuse.SetAttrIn{SetAttrInCommon: gofuse.SetAttrInCommon{InHeader: *hdr(e.NodeId), Valid: gofuse.FATTR_SIZE}}, &ao); errno != syscall.EINVAL {
			t.Errorf("truncate %s: %v", s.name, errno)
		}
	}
	if s := tf.Stats(); s.Handles != 0 {
		t.Fatalf("handles leaked: %+v", s)
	}
}

func TestMkdirRmdirUnlinkRename(t *testing.T) {
	tf := newTestFS(t, Options{})
	d := tf.mkdir(rootID, "d", 0o750)
	if d.Mode != unix.S_IFDIR|0o750 {
		t.Fatalf("mkdir mode %o", d.Mode)
	}
	var eo gofuse.EntryOut
	if errno := tf.Mkdir(&gofuse.MkdirIn{InHeader: *hdr(rootID), Mode: 0o755}, noGroup, nil, []byte("d"), &eo); errno != syscall.EEXIST {
		t.Fatalf("mkdir existing: %v", errno)
	}
	c := tf.create(d.NodeId, "f", unix.O_WRONLY, 0o644)
	tf.release(c.NodeId, c.Fh)
	if errno := tf.Rmdir(hdr(rootID), []byte("d")); errno != syscall.ENOTEMPTY {
		t.Fatalf("rmdir non-empty: %v", errno)
	}
	// rename across directories
	if errno := tf.Rename(hdr(d.NodeId), rootID, 0, []byte("f"), []byte("g")); errno != 0 {
		t.Fatal(errno)
	}
	if _, err := os.Stat(tf.path("g")); err != nil {
		t.Fatal(err)
	}
	os.WriteFile(tf.path("h"), []byte("h"), 0o644)
	if errno := tf.Rename(hdr(rootID), rootID, unix.RENAME_NOREPLACE, []byte("g"), []byte("h")); errno != syscall.EEXIST {
		t.Fatalf("NOREPLACE: %v", errno)
	}
	os.WriteFile(tf.path("g"), []byte("g"), 0o644)
	if errno := tf.Rename(hdr(rootID), rootID, unix.RENAME_EXCHANGE, []byte("g"), []byte("h")); errno != 0 {
		t.Fatalf("EXCHANGE: %v", errno)
	}
	if b, _ := os.ReadFile(tf.path("g")); string(b) != "h" {
		t.Fatalf("exchange: g=%q", b)
	}
	if errno := tf.Rename(hdr(rootID), rootID, 1<<7, []byte("g"), []byte("h")); errno != syscall.EINVAL {
		t.Fatalf("bad flags: %v", errno)
	}
	if errno := tf.Rename(hdr(rootID), rootID, 0, []byte("g"), []byte("h")); errno != 0 {
		t.Fatalf("rename over: %v", errno)
	}
	if errno := tf.Unlink(hdr(rootID), []byte("h")); errno != 0 {
		t.Fatal(errno)
	}
	if errno := tf.Unlink(hdr(rootID), []byte("h")); errno != syscall.ENOENT {
		t.Fatalf("unlink missing: %v", errno)
	}
	if errno := tf.Rmdir(hdr(rootID), []byte("d")); errno != 0 {
		t.Fatalf("rmdir: %v", errno)
	}
	if errno := tf.Unlink(hdr(c.NodeId), []byte("x")); errno != syscall.ENOTDIR {
		t.Fatalf("unlink in a file: %v", errno)
	}
}

func TestSymlinkLinkReadlink(t *testing.T) {
	tf := newTestFS(t, Options{})
	var s gofuse.EntryOut
	if errno := tf.Symlink(hdr(rootID), noGroup, nil, []byte("/etc/passwd"), []byte("s"), &s); errno != 0 {
		t.Fatal(errno)
	}
	if s.Mode&unix.S_IFMT != unix.S_IFLNK {
		t.Fatalf("symlink mode %o", s.Mode)
	}
	if tgt, _ := os.Readlink(tf.path("s")); tgt != "/etc/passwd" {
		t.Fatalf("host link %q", tgt)
	}
	if errno := tf.Symlink(hdr(rootID), noGroup, nil, nil, []byte("e"), &s); errno != syscall.EINVAL {
		t.Fatalf("empty target: %v", errno)
	}
	// Hard link of a symlink links the symlink itself.
	var l gofuse.EntryOut
	if errno := tf.Link(&gofuse.LinkIn{InHeader: *hdr(rootID), Oldnodeid: tf.lookup(rootID, "s").NodeId}, []byte("s2"), &l); errno != 0 {
		t.Fatalf("link symlink: %v", errno)
	}
	if st := statHost(t, tf.path("s2")); st.Mode&unix.S_IFMT != unix.S_IFLNK || st.Nlink != 2 {
		t.Fatalf("s2: mode %o nlink %d", st.Mode, st.Nlink)
	}
	os.WriteFile(tf.path("f"), []byte("x"), 0o644)
	f := tf.lookup(rootID, "f")
	if errno := tf.Link(&gofuse.LinkIn{InHeader: *hdr(rootID), Oldnodeid: f.NodeId}, []byte("f2"), &l); errno != 0 {
		t.Fatal(errno)
	}
	if l.NodeId != f.NodeId || l.Nlink != 2 {
		t.Fatalf("link entry %+v", l)
	}
	d := tf.mkdir(rootID, "d", 0o755)
	if errno := tf.Link(&gofuse.LinkIn{InHeader: *hdr(rootID), Oldnodeid: d.NodeId}, []byte("d2"), &l); errno != syscall.EPERM {
		t.Fatalf("link dir: %v", errno)
	}
	buf := make([]byte, 10)
	if _, errno := tf.Readlink(hdr(f.NodeId), buf); errno != syscall.EINVAL {
		t.Fatalf("readlink file: %v", errno)
	}
}

func TestReadDir(t *testing.T) {
	tf := newTestFS(t, Options{})
	want := map[string]bool{".": true, "..": true}
	for i := range 1000 {
		n := fmt.Sprintf("file%04d", i)
		os.WriteFile(tf.path(n), nil, 0o644)
		want[n] = true
	}
	os.Mkdir(tf.path("dir"), 0o755)
	want["dir"] = true
	for _, per := range []int{1, 7, 100000} {
		got := tf.readdirAll(rootID, false, per)
		seen := map[string]bool{}
		for _, d := range got {
			if seen[d.name] {
				t.Fatalf("per=%d: %q twice", per, d.name)
			}
			seen[d.name] = true
			if d.name == "dir" && d.typ != unix.S_IFDIR || strings.HasPrefix(d.name, "file") && d.typ != unix.S_IFREG {
				t.Errorf("%s: type %o", d.name, d.typ)
			}
		}
		if len(seen) != len(want) {
			t.Fatalf("per=%d: %d entries, want %d", per, len(seen), len(want))
		}
	}
	// Seeking back to an earlier cookie restarts there.
	all := tf.readdirAll(rootID, false, 100000)
	fh := tf.opendir(rootID)
	var names []string
	tf.ReadDir(&gofuse.ReadIn{InHeader: *hdr(rootID), Fh: fh, Offset: all[500].off}, false,
		func(name []byte, ino uint64, typ uint32, off uint64) (*gofuse.EntryOut, bool) {
			names = append(names, string(name))
			return nil, len(names) < 3
		})
	if len(names) != 3 || names[0] != all[501].name {
		t.Fatalf("after seek: %v, want %s first", names, all[501].name)
	}
	if s := tf.Stats(); s.Inodes != 0 {
		t.Fatalf("readdir took lookups: %+v", s)
	}
}

func TestReadDirPlus(t *testing.T) {
	tf := newTestFS(t, Options{})
	for i := range 50 {
		os.WriteFile(tf.path(fmt.Sprintf("f%02d", i)), []byte("abc"), 0o644)
	}
	os.Symlink("/", tf.path("link"))
	got := tf.readdirAll(rootID, true, 7)
	var nodes []uint64
	for _, d := range got {
		switch d.name {
		case ".", "..":
			if d.entry.NodeId != 0 {
				t.Errorf("%s has node %d", d.name, d.entry.NodeId)
			}
		default:
			host := statHost(t, tf.path(d.name))
			if d.entry.NodeId == 0 || d.entry.Ino != host.Ino || d.entry.Mode != host.Mode {
				t.Errorf("%s: entry %+v", d.name, d.entry)
			}
			nodes = append(nodes, d.entry.NodeId)
		}
	}
	if len(nodes) != 51 {
		t.Fatalf("%d entries", len(nodes))
	}
	// Exactly one lookup per emitted entry: one forget each frees all.
	if s := tf.Stats(); s.Inodes != 51 {
		t.Fatalf("stats %+v", s)
	}
	for _, n := range nodes {
		tf.Forget(n, 1)
	}
	if s := tf.Stats(); s.Inodes != 0 || s.InodeFDs != tf.baseFDs {
		t.Fatalf("after forget %+v", s)
	}
}

func TestSetAttr(t *testing.T) {
	tf := newTestFS(t, Options{})
	os.WriteFile(tf.path("f"), []byte("0123456789"), 0o644)
	e := tf.lookup(rootID, "f")
	set := func(in gofuse.SetAttrInCommon) gofuse.AttrOut {
		t.Helper()
		in.InHeader = *hdr(e.NodeId)
		var out gofuse.AttrOut
		if errno := tf.SetAttr(&gofuse.SetAttrIn{SetAttrInCommon: in}, &out); errno != 0 {
			t.Fatalf("setattr %#x: %v", in.Valid, errno)
		}
		return out
	}
	if a := set(gofuse.SetAttrInCommon{Valid: gofuse.FATTR_MODE, Mode: 0o600}); a.Mode != unix.S_IFREG|0o600 {
		t.Fatalf("chmod: %o", a.Mode)
	}
	in := gofuse.SetAttrInCommon{Valid: gofuse.FATTR_UID | gofuse.FATTR_GID}
	in.Uid, in.Gid = 1000, 2000
	if a := set(in); a.Uid != 1000 || a.Gid != 2000 {
		t.Fatalf("chown: %d:%d", a.Uid, a.Gid)
	}
	if a := set(gofuse.SetAttrInCommon{Valid: gofuse.FATTR_SIZE, Size: 4}); a.Size != 4 {
		t.Fatalf("truncate: %d", a.Size)
	}
	fh := tf.open(e.NodeId, unix.O_RDWR)
	if a := set(gofuse.SetAttrInCommon{Valid: gofuse.FATTR_SIZE | gofuse.FATTR_FH, Fh: fh, Size: 2}); a.Size != 2 {
		t.Fatalf("ftruncate: %d", a.Size)
	}
	a := set(gofuse.SetAttrInCommon{Valid: gofuse.FATTR_ATIME | gofuse.FATTR_MTIME, Atime: 1000, Atimensec: 5, Mtime: 2000, Mtimensec: 7})
	if a.Atime != 1000 || a.Atimensec != 5 || a.Mtime != 2000 || a.Mtimensec != 7 {
		t.Fatalf("utimes: %+v", a.Attr)
	}
	a = set(gofuse.SetAttrInCommon{Valid: gofuse.FATTR_MTIME | gofuse.FATTR_MTIME_NOW | gofuse.FATTR_FH, Fh: fh})
	if a.Atime != 1000 || time.Since(time.Unix(int64(a.Mtime), 0)) > time.Minute {
		t.Fatalf("mtime now: %+v", a.Attr)
	}
	// ctime alone is ignored.
	set(gofuse.SetAttrInCommon{Valid: gofuse.FATTR_CTIME, Ctime: 5})
	var out gofuse.AttrOut
	if errno := tf.SetAttr(&gofuse.SetAttrIn{SetAttrInCommon: gofuse.SetAttrInCommon{InHeader: *hdr(e.NodeId), Valid: gofuse.FATTR_FH | gofuse.FATTR_SIZE, Fh: fh + 1}}, &out); errno != syscall.EBADF {
		t.Fatalf("bad fh: %v", errno)
	}
	tf.release(e.NodeId, fh)
	d := tf.mkdir(rootID, "d", 0o755)
	if errno := tf.SetAttr(&gofuse.SetAttrIn{SetAttrInCommon: gofuse.SetAttrInCommon{InHeader: *hdr(d.NodeId), Valid: gofuse.FATTR_SIZE}}, &out); errno != syscall.EISDIR {
		t.Fatalf("truncate dir: %v", errno)
	}
}

func TestKillPriv(t *testing.T) {
	tf := newTestFS(t, Options{KillprivV2: true})
	mk := func(mode uint32) (gofuse.EntryOut, string) {
		p := tf.path("f")
		os.Remove(p)
		os.WriteFile(p, []byte("data"), 0o644)
		os.Chmod(p, os.FileMode(mode&0o777)|modeBits(mode))
		return tf.lookup(rootID, "f"), p
	}
	mode := func(p string) uint32 { return statHost(t, p).Mode & 0o7777 }
	// WRITE with FUSE_WRITE_KILL_SUIDGID.
	for _, tc := range []struct{ before, after uint32 }{
		{0o6755, 0o0755}, // suid and group-executable sgid go
		{0o6745, 0o2745}, // sgid without group exec stays
		{0o0755, 0o0755},
	} {
		e, p := mk(tc.before)
		fh := tf.open(e.NodeId, unix.O_WRONLY)
		tf.write(e.NodeId, fh, 0, []byte("x"), 0)
		if got := mode(p); got != tc.before {
			t.Errorf("write without kill flag changed %o to %o", tc.before, got)
		}
		tf.write(e.NodeId, fh, 0, []byte("x"), gofuse.WRITE_KILL_SUIDGID)
		if got := mode(p); got != tc.after {
			t.Errorf("write kill: %o -> %o, want %o", tc.before, got, tc.after)
		}
		tf.release(e.NodeId, fh)
		tf.Forget(e.NodeId, 1)
	}
	// SETATTR size with FATTR_KILL_SUIDGID, with and without a handle.
	for _, withFH := range []bool{false, true} {
		e, p := mk(0o6755)
		in := gofuse.SetAttrInCommon{InHeader: *hdr(e.NodeId), Valid: gofuse.FATTR_SIZE | gofuse.FATTR_KILL_SUIDGID, Size: 1}
		if withFH {
			in.Fh = tf.open(e.NodeId, unix.O_RDWR)
			in.Valid |= gofuse.FATTR_FH
		}
		var out gofuse.AttrOut
		if errno := tf.SetAttr(&gofuse.SetAttrIn{SetAttrInCommon: in}, &out); errno != 0 {
			t.Fatal(errno)
		}
		if got := mode(p); got != 0o755 || out.Mode&0o7777 != 0o755 || out.Size != 1 {
			t.Errorf("setattr kill (fh %v): host %o reply %o", withFH, got, out.Mode)
		}
		if withFH {
			tf.release(e.NodeId, in.Fh)
		}
		tf.Forget(e.NodeId, 1)
	}
	// OPEN and CREATE with O_TRUNC and FUSE_OPEN_KILL_SUIDGID.
	e, p := mk(0o6755)
	var oo gofuse.OpenOut
	if errno := tf.Open(&gofuse.OpenIn{InHeader: *hdr(e.NodeId), Flags: unix.O_WRONLY | unix.O_TRUNC, Mode: gofuse.OPEN_KILL_SUIDGID}, &oo); errno != 0 {
		t.Fatal(errno)
	}
	if got := mode(p); got != 0o755 {
		t.Errorf("open O_TRUNC kill: %o", got)
	}
	tf.release(e.NodeId, oo.Fh)
	tf.Forget(e.NodeId, 1)
	e, p = mk(0o6755)
	var co gofuse.CreateOut
	if errno := tf.Create(&gofuse.CreateIn{InHeader: *hdr(rootID), Flags: unix.O_WRONLY | unix.O_TRUNC, Mode: 0o644, OpenFlags: gofuse.OPEN_KILL_SUIDGID}, noGroup, nil, []byte("f"), &co); errno != 0 {
		t.Fatal(errno)
	}
	if got := mode(p); got != 0o755 {
		t.Errorf("create O_TRUNC kill: %o", got)
	}
	tf.release(co.NodeId, co.Fh)
}

func modeBits(m uint32) os.FileMode {
	var fm os.FileMode
	if m&unix.S_ISUID != 0 {
		fm |= os.ModeSetuid
	}
	if m&unix.S_ISGID != 0 {
		fm |= os.ModeSetgid
	}
	return fm
}

func TestCredentialsOnCreate(t *testing.T) {
	tf := newTestFS(t, Options{})
	os.Chmod(tf.dir, 0o777)
	var e gofuse.EntryOut
	if errno := tf.Mkdir(&gofuse.MkdirIn{InHeader: *hdrAs(rootID, 1000, 1001), Mode: 0o755}, noGroup, nil, []byte("d"), &e); errno != 0 {
		t.Fatal(errno)
	}
	var co gofuse.CreateOut
	if errno := tf.Create(&gofuse.CreateIn{InHeader: *hdrAs(e.NodeId, 1000, 1001), Flags: unix.O_RDWR, Mode: 0o600}, noGroup, nil, []byte("f"), &co); errno != 0 {
		t.Fatal(errno)
	}
	tf.release(co.NodeId, co.Fh)
	if errno := tf.Symlink(hdrAs(e.NodeId, 1000, 1001), noGroup, nil, []byte("t"), []byte("s"), &e); errno != 0 {
		t.Fatal(errno)
	}
	d := tf.lookup(rootID, "d")
	if errno := tf.Mknod(&gofuse.MknodIn{InHeader: *hdrAs(d.NodeId, 1000, 1001), Mode: unix.S_IFIFO | 0o600}, noGroup, nil, []byte("p"), &e); errno != 0 {
		t.Fatal(errno)
	}
	for _, n := range []string{"d", "d/f", "d/s", "d/p"} {
		st := statHost(t, tf.path(n))
		if st.Uid != 1000 || st.Gid != 1001 {
			t.Errorf("%s owned by %d:%d", n, st.Uid, st.Gid)
		}
	}
	// The caller's permissions apply: uid 1000 may not create in a
	// root-owned 0755 directory.
	os.Mkdir(tf.path("rootonly"), 0o755)
	r := tf.lookup(rootID, "rootonly")
	if errno := tf.Mkdir(&gofuse.MkdirIn{InHeader: *hdrAs(r.NodeId, 1000, 1000), Mode: 0o755}, noGroup, nil, []byte("x"), &e); errno != syscall.EACCES {
		t.Fatalf("mkdir as 1000 in root's dir: %v", errno)
	}
	// The calling thread's credentials are untouched.
	if uid, _ := unix.SetfsuidRetUid(-1); uid != 0 {
		t.Fatalf("fsuid now %d", uid)
	}
	// Modes are applied as sent (the guest applied its umask) — no
	// daemon umask interferes: New clears the process umask.
	old := unix.Umask(0o077)
	defer unix.Umask(old)
	tf = newTestFS(t, Options{})
	if errno := tf.Mkdir(&gofuse.MkdirIn{InHeader: *hdr(rootID), Mode: 0o777}, noGroup, nil, []byte("open"), &e); errno != 0 {
		t.Fatal(errno)
	}
	if e.Mode&0o777 != 0o777 {
		t.Fatalf("mode %o: daemon umask applied", e.Mode)
	}
}

func TestDontMaskUmask(t *testing.T) {
	tf := newTestFS(t, Options{Xattr: true, PosixACL: true})
	if tf.Capabilities()&gofuse.CAP_DONT_MASK == 0 {
		t.Fatal("no DONT_MASK with posix acl")
	}
	var e gofuse.EntryOut
	if errno := tf.Mkdir(&gofuse.MkdirIn{InHeader: *hdr(rootID), Mode: 0o777, Umask: 0o027}, noGroup, nil, []byte("d"), &e); errno != 0 {
		t.Fatal(errno)
	}
	if e.Mode&0o777 != 0o750 {
		t.Fatalf("guest umask not applied: %o", e.Mode)
	}
}

func TestMiscOps(t *testing.T) {
	tf := newTestFS(t, Options{})
	// sparse file: data at 0 and at 1 MiB
	f, _ := os.Create(tf.path("sparse"))
	f.WriteAt([]byte("a"), 0)
	f.WriteAt([]byte("b"), 1<<20)
	f.Close()
	e := tf.lookup(rootID, "sparse")
	fh := tf.open(e.NodeId, unix.O_RDWR)

	var so gofuse.StatfsOut
	if errno := tf.StatFs(hdr(e.NodeId), &so); errno != 0 || so.Blocks == 0 || so.NameLen != 255 {
		t.Fatalf("statfs %+v %v", so, errno)
	}
	var lo gofuse.LseekOut
	if errno := tf.Lseek(&gofuse.LseekIn{InHeader: *hdr(e.NodeId), Fh: fh, Offset: 8192, Whence: unix.SEEK_DATA}, &lo); errno != 0 {
		t.Fatal(errno)
	}
	if lo.Offset != 1<<20 {
		t.Fatalf("SEEK_DATA from 8192: %d", lo.Offset)
	}
	if errno := tf.Lseek(&gofuse.LseekIn{InHeader: *hdr(e.NodeId), Fh: fh, Offset: 0, Whence: unix.SEEK_HOLE}, &lo); errno != 0 || lo.Offset == 0 || lo.Offset >= 1<<20 {
		t.Fatalf("SEEK_HOLE: %d %v", lo.Offset, errno)
	}
	if errno := tf.Fallocate(&gofuse.FallocateIn{InHeader: *hdr(e.NodeId), Fh: fh, Offset: 0, Length: 4 << 20}); errno != 0 {
		t.Fatal(errno)
	}
	if st := statHost(t, tf.path("sparse")); st.Size != 4<<20 {
		t.Fatalf("fallocate size %d", st.Size)
	}
	if errno := tf.Fallocate(&gofuse.FallocateIn{InHeader: *hdr(e.NodeId), Fh: fh, Offset: 0, Length: 4096, Mode: unix.FALLOC_FL_PUNCH_HOLE | unix.FALLOC_FL_KEEP_SIZE}); errno != 0 {
		t.Fatal(errno)
	}
	c := tf.create(rootID, "copy", unix.O_RDWR, 0o644)
	n, errno := tf.CopyFileRange(&gofuse.CopyFileRangeIn{InHeader: *hdr(e.NodeId), FhIn: fh, OffIn: 1 << 20, NodeIdOut: c.NodeId, FhOut: c.Fh, OffOut: 10, Len: 1}, ^uint64(0))
	if errno != 0 || n != 1 {
		t.Fatalf("copy_file_range %d %v", n, errno)
	}
	if b, _ := os.ReadFile(tf.path("copy")); len(b) != 11 || b[10] != 'b' {
		t.Fatalf("copy content %q", b)
	}
	if errno := tf.SyncFs(hdr(rootID)); errno != 0 {
		t.Fatal(errno)
	}
	if errno := tf.SyncFs(hdr(e.NodeId)); errno != 0 {
		t.Fatal(errno)
	}
	var sx gofuse.StatxOut
	if errno := tf.Statx(&gofuse.StatxIn{InHeader: *hdr(e.NodeId), SxMask: unix.STATX_BASIC_STATS | unix.STATX_BTIME}, &sx); errno != 0 {
		t.Fatal(errno)
	}
	if sx.Size != 4<<20 || sx.Mode&unix.S_IFMT != unix.S_IFREG || sx.Ino != e.Ino || sx.AttrValid != 1 {
		t.Fatalf("statx %+v", sx)
	}
	// access: mode-bit check for the caller
	os.Chmod(tf.path("sparse"), 0o640)
	os.Chown(tf.path("sparse"), 1000, 1000)
	acc := func(uid, gid, mask uint32) syscall.Errno {
		return tf.Access(&gofuse.AccessIn{InHeader: *hdrAs(e.NodeId, uid, gid), Mask: mask})
	}
	if acc(1000, 1, unix.R_OK|unix.W_OK) != 0 || acc(2000, 1000, unix.R_OK) != 0 ||
		acc(2000, 1000, unix.W_OK) != syscall.EACCES || acc(2000, 2000, unix.R_OK) != syscall.EACCES ||
		acc(0, 0, unix.R_OK|unix.W_OK) != 0 || acc(0, 0, unix.X_OK) != syscall.EACCES || acc(3000, 3000, 0) != 0 {
		t.Fatal("access checks")
	}
	if errno := tf.FsyncDir(&gofuse.FsyncIn{InHeader: *hdr(rootID), Fh: fh}); errno != syscall.EBADF {
		t.Fatalf("fsyncdir with a file handle: %v", errno)
	}
	dfh := tf.opendir(rootID)
	if errno := tf.FsyncDir(&gofuse.FsyncIn{InHeader: *hdr(rootID), Fh: dfh}); errno != 0 {
		t.Fatal(errno)
	}
	tf.release(e.NodeId, fh)
	tf.release(c.NodeId, c.Fh)
}

func TestTmpfile(t *testing.T) {
	tf := newTestFS(t, Options{})
	os.Chmod(tf.dir, 0o777)
	var co gofuse.CreateOut
	if errno := tf.Tmpfile(&gofuse.CreateIn{InHeader: *hdrAs(rootID, 1000, 1000), Flags: unix.O_RDWR, Mode: 0o600}, noGroup, nil, &co); errno != 0 {
		if errno == syscall.EOPNOTSUPP {
			t.Skip("no O_TMPFILE here")
		}
		t.Fatal(errno)
	}
	if co.Nlink != 0 || co.Uid != 1000 {
		t.Fatalf("tmpfile entry %+v", co.EntryOut)
	}
	tf.write(co.NodeId, co.Fh, 0, []byte("tmp"), 0)
	var l gofuse.EntryOut
	if errno := tf.Link(&gofuse.LinkIn{InHeader: *hdr(rootID), Oldnodeid: co.NodeId}, []byte("named"), &l); errno != 0 {
		t.Fatalf("link tmpfile: %v", errno)
	}
	if b, _ := os.ReadFile(tf.path("named")); string(b) != "tmp" {
		t.Fatalf("linked content %q", b)
	}
	tf.release(co.NodeId, co.Fh)
	// O_TMPFILE|O_EXCL: never linkable.
	if errno := tf.Tmpfile(&gofuse.CreateIn{InHeader: *hdr(rootID), Flags: unix.O_RDWR | unix.O_EXCL, Mode: 0o600}, noGroup, nil, &co); errno != 0 {
		t.Fatal(errno)
	}
	if errno := tf.Link(&gofuse.LinkIn{InHeader: *hdr(rootID), Oldnodeid: co.NodeId}, []byte("named2"), &l); errno == 0 {
		t.Fatal("linked an O_EXCL tmpfile")
	}
	tf.release(co.NodeId, co.Fh)
}

func TestXattr(t *testing.T) {
	tf0 := newTestFS(t, Options{})
	if _, errno := tf0.GetXAttr(hdr(rootID), []byte("user.x"), nil); errno != syscall.ENOSYS {
		t.Fatalf("xattr disabled: %v", errno)
	}
	tf := newTestFS(t, Options{Xattr: true})
	os.WriteFile(tf.path("f"), nil, 0o644)
	unix.Mkfifo(tf.path("fifo"), 0o644)
	for _, name := range []string{"f", "."} {
		e := tf.lookup(rootID, name)
		h := hdr(e.NodeId)
		if errno := tf.SetXAttr(&gofuse.SetXAttrIn{InHeader: *h}, []byte("user.k"), []byte("value")); errno != 0 {
			t.Fatal(errno)
		}
		n, errno := tf.GetXAttr(h, []byte("user.k"), nil)
		if errno != 0 || n != 5 {
			t.Fatalf("size query %d %v", n, errno)
		}
		small := make([]byte, 2)
		if _, errno := tf.GetXAttr(h, []byte("user.k"), small); errno != syscall.ERANGE {
			t.Fatalf("small buffer: %v", errno)
		}
		buf := make([]byte, 64)
		n, errno = tf.GetXAttr(h, []byte("user.k"), buf)
		if errno != 0 || string(buf[:n]) != "value" {
			t.Fatalf("get %q %v", buf[:n], errno)
		}
		n, errno = tf.ListXAttr(h, nil)
		if errno != 0 || n == 0 {
			t.Fatalf("list size %d %v", n, errno)
		}
		n, errno = tf.ListXAttr(h, buf)
		if errno != 0 || !bytes.Contains(buf[:n], []byte("user.k\x00")) {
			t.Fatalf("list %q %v", buf[:n], errno)
		}
		if errno := tf.RemoveXAttr(h, []byte("user.k")); errno != 0 {
			t.Fatal(errno)
		}
		if _, errno := tf.GetXAttr(h, []byte("user.k"), buf); errno != syscall.ENODATA {
			t.Fatalf("after remove: %v", errno)
		}
	}
	// A FIFO is never opened; its xattrs go through the /proc path.
	fifo := tf.lookup(rootID, "fifo")
	done := make(chan syscall.Errno)
	go func() {
		done <- tf.SetXAttr(&gofuse.SetXAttrIn{InHeader: *hdr(fifo.NodeId)}, []byte("trusted.k"), []byte("v"))
	}()
	select {
	case errno := <-done:
		if errno != 0 {
			t.Fatalf("setxattr fifo: %v", errno)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("xattr on a FIFO blocked")
	}
	var b [8]byte
	if n, _ := unix.Getxattr(tf.path("fifo"), "trusted.k", b[:]); string(b[:n]) != "v" {
		t.Fatalf("fifo xattr %q", b[:n])
	}
	// ACL names are refused without posix_acl.
	if errno := tf.SetXAttr(&gofuse.SetXAttrIn{InHeader: *hdr(rootID)}, []byte("system.posix_acl_access"), []byte{2, 0, 0, 0}); errno != syscall.EOPNOTSUPP {
		t.Fatalf("acl without posix_acl: %v", errno)
	}
	if _, errno := tf.GetXAttr(hdr(rootID), []byte(strings.Repeat("u", 256)), nil); errno != syscall.ERANGE {
		t.Fatalf("long name: %v", errno)
	}
}

func TestLocks(t *testing.T) {
	tf0 := newTestFS(t, Options{})
	if errno := tf0.SetLk(&gofuse.LkIn{}, false); errno != syscall.ENOSYS {
		t.Fatalf("locks disabled: %v", errno)
	}
	tf := newTestFS(t, Options{PosixLocks: true, Flock: true, MaxLocks: 3})
	os.WriteFile(tf.path("f"), []byte("x"), 0o644)
	e := tf.lookup(rootID, "f")
	fh1 := tf.open(e.NodeId, unix.O_RDWR)
	fh2 := tf.open(e.NodeId, unix.O_RDWR)
	lk := func(fh, owner uint64, typ uint32, start, end uint64) *gofuse.LkIn {
		return &gofuse.LkIn{InHeader: *hdr(e.NodeId), Fh: fh, Owner: owner, Lk: gofuse.FileLock{Start: start, End: end, Typ: typ}}
	}
	const eof = 1<<63 - 1
	if errno := tf.SetLk(lk(fh1, 1, unix.F_WRLCK, 0, 9), false); errno != 0 {
		t.Fatal(errno)
	}
	// Same owner through another handle: no conflict (POSIX locks are
	// per owner, not per open).
	if errno := tf.SetLk(lk(fh2, 1, unix.F_WRLCK, 5, 20), false); errno != 0 {
		t.Fatalf("same owner: %v", errno)
	}
	if errno := tf.SetLk(lk(fh2, 2, unix.F_RDLCK, 0, 0), false); errno != syscall.EAGAIN {
		t.Fatalf("conflict: %v", errno)
	}
	// SETLKW never blocks.
	done := make(chan syscall.Errno)
	go func() { done <- tf.SetLk(lk(fh2, 2, unix.F_WRLCK, 0, eof), true) }()
	select {
	case errno := <-done:
		if errno != syscall.EAGAIN {
			t.Fatalf("setlkw contended: %v", errno)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("SETLKW blocked")
	}
	var out gofuse.LkOut
	if errno := tf.GetLk(lk(fh2, 2, unix.F_WRLCK, 0, eof), &out); errno != 0 || out.Lk.Typ != unix.F_WRLCK || out.Lk.Start != 0 || out.Lk.End != 20 {
		t.Fatalf("getlk %+v %v", out, errno)
	}
	if errno := tf.SetLk(lk(fh2, 3, unix.F_WRLCK, 100, eof), true); errno != 0 {
		t.Fatalf("setlkw uncontended: %v", errno)
	}
	// The bound on lock owners.
	if errno := tf.SetLk(lk(fh2, 4, unix.F_RDLCK, 200, 200), false); errno != syscall.ENOLCK {
		t.Fatalf("beyond MaxLocks: %v", errno)
	}
	// FLUSH of owner 1 drops its locks.
	tf.Flush(&gofuse.FlushIn{InHeader: *hdr(e.NodeId), Fh: fh1, LockOwner: 1})
	if errno := tf.SetLk(lk(fh2, 2, unix.F_WRLCK, 0, 50), false); errno != 0 {
		t.Fatalf("after flush: %v", errno)
	}
	// flock
	fl := func(fh uint64, typ uint32) syscall.Errno {
		in := lk(fh, 9, typ, 0, 0)
		in.LkFlags = gofuse.LK_FLOCK
		return tf.SetLk(in, true)
	}
	if fl(fh1, unix.F_WRLCK) != 0 || fl(fh2, unix.F_RDLCK) != syscall.EAGAIN || fl(fh1, unix.F_UNLCK) != 0 || fl(fh2, unix.F_RDLCK) != 0 {
		t.Fatal("flock")
	}
	tf.release(e.NodeId, fh1)
	tf.release(e.NodeId, fh2)
	tf.Forget(e.NodeId, 1)
	if s := tf.Stats(); s.LockFDs != 0 || s.Inodes != 0 {
		t.Fatalf("stats %+v", s)
	}
}

func TestSessionReset(t *testing.T) {
	tf := newTestFS(t, Options{PosixLocks: true})
	for i := range 20 {
		os.WriteFile(tf.path(fmt.Sprint(i)), []byte("x"), 0o644)
	}
	var ids, fhs []uint64
	for i := range 20 {
		e := tf.lookup(rootID, fmt.Sprint(i))
		ids = append(ids, e.NodeId)
		fhs = append(fhs, tf.open(e.NodeId, unix.O_RDWR))
	}
	tf.SetLk(&gofuse.LkIn{InHeader: *hdr(ids[0]), Fh: fhs[0], Owner: 1, Lk: gofuse.FileLock{Typ: unix.F_WRLCK, End: 10}}, false)
	dfh := tf.opendir(rootID)
	check := func(what string) {
		t.Helper()
		if s := tf.Stats(); s != (Stats{InodeFDs: tf.baseFDs}) {
			t.Fatalf("%s: %+v", what, s)
		}
		var ao gofuse.AttrOut
		if errno := tf.GetAttr(&gofuse.GetAttrIn{InHeader: *hdr(ids[3])}, &ao); errno != syscall.EBADF {
			t.Fatalf("%s: old node: %v", what, errno)
		}
		buf := make([]byte, 1)
		if _, errno := tf.Read(&gofuse.ReadIn{InHeader: *hdr(ids[3]), Fh: fhs[3], Size: 1}, vecOver(buf)); errno != syscall.EBADF {
			t.Fatalf("%s: old handle: %v", what, errno)
		}
		if errno := tf.ReadDir(&gofuse.ReadIn{InHeader: *hdr(rootID), Fh: dfh}, false, nil); errno != syscall.EBADF {
			t.Fatalf("%s: old dir handle: %v", what, errno)
		}
		tf.getattr(rootID)
	}
	tf.Init(tf.Capabilities()) // second INIT
	check("second init")
	e := tf.lookup(rootID, "1")
	tf.open(e.NodeId, unix.O_RDONLY)
	tf.Destroy()
	ids, fhs = append(ids, e.NodeId), append(fhs, 0)
	check("destroy")
	tf.Init(tf.Capabilities())
	tf.lookup(rootID, "1")
}

func TestAnnounceSubmounts(t *testing.T) {
	tf := newTestFS(t, Options{AnnounceSubmounts: true})
	if tf.Capabilities()&gofuse.CAP_SUBMOUNTS == 0 {
		t.Fatal("no CAP_SUBMOUNTS")
	}
	os.Mkdir(tf.path("mnt"), 0o755)
	os.Mkdir(tf.path("plain"), 0o755)
	if err := unix.Mount("tmpfs", tf.path("mnt"), "tmpfs", 0, "size=1m"); err != nil {
		t.Skipf("cannot mount here: %v", err)
	}
	defer unix.Unmount(tf.path("mnt"), unix.MNT_DETACH)
	os.WriteFile(tf.path("mnt/inner"), nil, 0o644)
	if e := tf.lookup(rootID, "mnt"); e.Flags&gofuse.ATTR_SUBMOUNT == 0 {
		t.Errorf("mount point without ATTR_SUBMOUNT")
	}
	if e := tf.lookup(rootID, "plain"); e.Flags&gofuse.ATTR_SUBMOUNT != 0 {
		t.Errorf("plain dir with ATTR_SUBMOUNT")
	}
	m := tf.lookup(rootID, "mnt")
	if e := tf.lookup(m.NodeId, "inner"); e.Flags&gofuse.ATTR_SUBMOUNT != 0 {
		t.Errorf("file inside the submount flagged")
	}
	// Without the option nothing is flagged.
	tf2, err := New(tf.dir, Options{}, testLog)
	if err != nil {
		t.Fatal(err)
	}
	defer tf2.Close()
	tf2.Init(^uint64(0))
	var e gofuse.EntryOut
	tf2.Lookup(hdr(rootID), []byte("mnt"), &e)
	if e.Flags&gofuse.ATTR_SUBMOUNT != 0 {
		t.Errorf("flagged without announce_submounts")
	}
}

func TestReadOnly(t *testing.T) {
	tf := newTestFS(t, Options{ReadOnly: true, Xattr: true})
	os.WriteFile(tf.path("f"), []byte("x"), 0o644)
	e := tf.lookup(rootID, "f")
	var oo gofuse.OpenOut
	if errno := tf.Open(&gofuse.OpenIn{InHeader: *hdr(e.NodeId), Flags: unix.O_RDWR}, &oo); errno != syscall.EROFS {
		t.Fatalf("open rw: %v", errno)
	}
	fh := tf.open(e.NodeId, unix.O_RDONLY)
	if _, errno := tf.Write(&gofuse.WriteIn{InHeader: *hdr(e.NodeId), Fh: fh, Size: 1}, vecOver([]byte("y"))); errno != syscall.EROFS {
		t.Fatalf("write: %v", errno)
	}
	var eo gofuse.EntryOut
	if errno := tf.Mkdir(&gofuse.MkdirIn{InHeader: *hdr(rootID)}, noGroup, nil, []byte("d"), &eo); errno != syscall.EROFS {
		t.Fatalf("mkdir: %v", errno)
	}
	if errno := tf.Unlink(hdr(rootID), []byte("f")); errno != syscall.EROFS {
		t.Fatalf("unlink: %v", errno)
	}
	if errno := tf.SetXAttr(&gofuse.SetXAttrIn{InHeader: *hdr(e.NodeId)}, []byte("user.x"), nil); errno != syscall.EROFS {
		t.Fatalf("setxattr: %v", errno)
	}
	if got := tf.read(e.NodeId, fh, 0, 1); string(got) != "x" {
		t.Fatal("read")
	}
}

func TestCapabilities(t *testing.T) {
	f := newTestFS(t, Options{})
	c := f.Capabilities()
	if c&gofuse.CAP_READDIRPLUS == 0 || c&gofuse.CAP_WRITEBACK_CACHE != 0 || c&gofuse.CAP_SECURITY_CTX != 0 ||
		c&gofuse.CAP_POSIX_LOCKS != 0 || c&gofuse.CAP_PARALLEL_DIROPS == 0 {
		t.Fatalf("default caps %#x", c)
	}
	g := newTestFS(t, Options{NoReaddirplus: true, KillprivV2: true, PosixLocks: true, Flock: true, SecurityLabel: true})
	c = g.Capabilities()
	if c&gofuse.CAP_READDIRPLUS != 0 || c&gofuse.CAP_HANDLE_KILLPRIV_V2 == 0 || c&gofuse.CAP_POSIX_LOCKS == 0 ||
		c&gofuse.CAP_FLOCK_LOCKS == 0 || c&gofuse.CAP_SECURITY_CTX == 0 {
		t.Fatalf("caps %#x", c)
	}
	if _, err := New(f.dir, Options{PosixACL: true}, testLog); err == nil {
		t.Fatal("posix acl without xattr accepted")
	}
	for _, s := range []string{"never", "none", "metadata", "auto", "always"} {
		if _, err := ParseCacheMode(s); err != nil {
			t.Fatal(err)
		}
	}
}

// TestCreateSuppGroup: a caller who may write a directory only through a
// supplementary group (CREATE_SUPP_GROUP sends it) creates there; without
// the group it may not, also on a worker thread that served a request with
// one before (the group is dropped after each request).
func TestCreateSuppGroup(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to switch credentials")
	}
	tf := newTestFS(t, Options{})
	if err := os.Mkdir(tf.path("g"), 0o770); err != nil {
		t.Fatal(err)
	}
	os.Chown(tf.path("g"), 0, 4242)
	os.Chmod(tf.path("g"), 0o770) // no setgid: the new objects get the caller's gid
	g := tf.lookup(rootID, "g").NodeId
	var eo gofuse.EntryOut
	var co gofuse.CreateOut
	mkdir := func(name string, group []uint32) syscall.Errno {
		return tf.Mkdir(&gofuse.MkdirIn{InHeader: *hdrAs(g, 1000, 1000), Mode: 0o755}, group, nil, []byte(name), &eo)
	}
	for range 2 * tf.creds.workers {
		if errno := mkdir("no", noGroup); errno != syscall.EACCES {
			t.Fatalf("mkdir without the group: %v, want EACCES", errno)
		}
	}
	for k := range 2 * tf.creds.workers {
		name := fmt.Sprint("d", k)
		if errno := mkdir(name, []uint32{4242}); errno != 0 {
			t.Fatalf("mkdir through the group: %v", errno)
		}
		if st := statHost(t, tf.path("g/"+name)); st.Uid != 1000 || st.Gid != 1000 {
			t.Fatalf("owner %d:%d, want 1000:1000", st.Uid, st.Gid)
		}
		if errno := mkdir("no", noGroup); errno != syscall.EACCES {
			t.Fatalf("mkdir without the group after one with it: %v, want EACCES", errno)
		}
	}
	if errno := tf.Create(&gofuse.CreateIn{InHeader: *hdrAs(g, 1000, 1000), Flags: unix.O_RDWR, Mode: 0o644}, []uint32{4242}, nil, []byte("f"), &co); errno != 0 {
		t.Fatalf("create through the group: %v", errno)
	}
	tf.release(co.NodeId, co.Fh)
	if errno := tf.Symlink(hdrAs(g, 1000, 1000), []uint32{4242}, nil, []byte("t"), []byte("s"), &eo); errno != 0 {
		t.Fatalf("symlink through the group: %v", errno)
	}
	if errno := tf.Mknod(&gofuse.MknodIn{InHeader: *hdrAs(g, 1000, 1000), Mode: unix.S_IFIFO | 0o644}, []uint32{4242}, nil, []byte("p"), &eo); errno != 0 {
		t.Fatalf("mknod through the group: %v", errno)
	}
	if errno := tf.Tmpfile(&gofuse.CreateIn{InHeader: *hdrAs(g, 1000, 1000), Flags: unix.O_RDWR, Mode: 0o600}, []uint32{4242}, nil, &co); errno != 0 {
		t.Fatalf("tmpfile through the group: %v", errno)
	}
	tf.release(co.NodeId, co.Fh)
	// The daemon's own groups are untouched.
	if gs, _ := unix.Getgroups(); len(gs) > 1 {
		t.Fatalf("process groups %v", gs)
	}
}
