package passthrough

import (
	"fmt"
	"os"
	"path/filepath"
	"syscall"
	"testing"

	gofuse "github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"
)

// newHandleFS is a file system holding inodes by file handle with an fd
// budget whose directory cache holds size fds, over dirs directories of
// one file each.
func newHandleFS(t *testing.T, size, dirs int) *testFS {
	t.Helper()
	tf := newTestFS(t, Options{InodeFileHandles: FileHandlesMandatory, InodeFDBudget: 4 * size})
	if !tf.useHandles {
		t.Skip("no file handles here")
	}
	if got := cap(tf.dirs.slots); got != size {
		t.Fatalf("cache of %d slots, want %d", got, size)
	}
	for d := range dirs {
		p := tf.path(fmt.Sprintf("d%d", d))
		os.Mkdir(p, 0o755)
		os.WriteFile(p+"/f", nil, 0o644)
	}
	return tf
}

// A directory held by handle keeps the fd its LOOKUP opened: a LOOKUP in
// it then opens nothing by handle for the parent, and the fd is counted,
// and closed at the directory's FORGET.
func TestDirCacheKeepsDirectoryFD(t *testing.T) {
	tf := newHandleFS(t, 16, 1)
	d := tf.lookup(rootID, "d0").NodeId
	i := tf.node(d)
	fd := i.residentFD()
	if fd < 0 || tf.dirs.fds.Load() != 1 {
		t.Fatalf("directory fd %d, cached %d", fd, tf.dirs.fds.Load())
	}
	f := tf.lookup(d, "f").NodeId
	if tf.node(f).residentFD() >= 0 {
		t.Fatal("a file's fd was cached")
	}
	r, errno := tf.getInode(d)
	if errno != 0 || r.fd != fd || r.ownedFD {
		t.Fatalf("getInode: %v, fd %d owned %v, want the cached %d", errno, r.fd, r.ownedFD, fd)
	}
	r.put()
	tf.Forget(f, 1)
	tf.Forget(d, 1)
	if s := tf.Stats(); s.Inodes != 0 || s.InodeFDs != tf.baseFDs || tf.dirs.fds.Load() != 0 {
		t.Fatalf("after forget: %+v, cached %d", s, tf.dirs.fds.Load())
	}
}

// More directories than the cache holds: the cache stays at its size,
// every directory keeps answering, and one whose fd was detached is
// opened by handle again.
func TestDirCacheBounded(t *testing.T) {
	const size, dirs = 4, 20
	tf := newHandleFS(t, size, dirs)
	var nodes []uint64
	for d := range dirs {
		nodes = append(nodes, tf.lookup(rootID, fmt.Sprintf("d%d", d)).NodeId)
		if n := tf.dirs.fds.Load(); n > size {
			t.Fatalf("%d directory fds cached, cache of %d", n, size)
		}
	}
	for round := range 3 {
		for _, d := range nodes {
			if e := tf.lookup(d, "f"); e.NodeId == 0 {
				t.Fatalf("round %d: lookup in %d", round, d)
			}
		}
	}
	if n, s := tf.dirs.fds.Load(), tf.Stats(); n != size || s.InodeFDs != tf.baseFDs+size {
		t.Fatalf("cached %d, stats %+v (base %d)", n, s, tf.baseFDs)
	}
}

// A directory with a request under way keeps its fd: the request's
// reference pins it however many others the cache takes meanwhile.
func TestDirCacheSparesDirectoryInUse(t *testing.T) {
	const size, dirs = 4, 16
	tf := newHandleFS(t, size, dirs)
	d0 := tf.lookup(rootID, "d0").NodeId
	r, errno := tf.getInode(d0)
	if errno != 0 {
		t.Fatal(errno)
	}
	defer r.put()
	for d := 1; d < dirs; d++ {
		tf.lookup(tf.lookup(rootID, fmt.Sprintf("d%d", d)).NodeId, "f")
	}
	if got := r.inode.residentFD(); got != r.fd {
		t.Fatalf("directory in use lost its fd: %d, had %d", got, r.fd)
	}
	var st syscall.Stat_t
	if err := syscall.Fstat(r.fd, &st); err != nil {
		t.Fatalf("fd of the directory in use: %v", err)
	}
	var out gofuse.EntryOut
	if errno := tf.Lookup(hdr(d0), []byte("f"), &out); errno != 0 {
		t.Fatalf("lookup in the directory in use: %v", errno)
	}
}

// A LOOKUP of a file or symlink on a mount held by handle opens nothing
// (lookupByHandle): no inode fd is left behind, the entry is
// the object's own (a symlink's, not its target's), and a repeated LOOKUP
// finds the same node.
func TestLookupByHandleOpensNothing(t *testing.T) {
	tf := newHandleFS(t, 16, 1)
	os.WriteFile(tf.path("d0/g"), []byte("12345"), 0o644)
	os.Symlink("g", tf.path("d0/l"))
	d := tf.lookup(rootID, "d0").NodeId
	before := tf.Stats().InodeFDs
	g := tf.lookup(d, "g")
	l := tf.lookup(d, "l")
	if tf.Stats().InodeFDs != before {
		t.Fatalf("inode fds %d after the lookups, %d before", tf.Stats().InodeFDs, before)
	}
	if g.Attr.Size != 5 || g.Attr.Mode&unix.S_IFMT != unix.S_IFREG {
		t.Fatalf("g: size %d mode %#o", g.Attr.Size, g.Attr.Mode)
	}
	if l.Attr.Mode&unix.S_IFMT != unix.S_IFLNK || l.Attr.Size != 1 {
		t.Fatalf("l: mode %#o size %d, want the symlink's own", l.Attr.Mode, l.Attr.Size)
	}
	if again := tf.lookup(d, "g"); again.NodeId != g.NodeId {
		t.Fatalf("g: node %d, then %d", g.NodeId, again.NodeId)
	}
	if a := tf.getattr(g.NodeId); a.Ino != g.Attr.Ino || a.Size != 5 {
		t.Fatalf("getattr g: ino %d size %d", a.Ino, a.Size)
	}
	// Replaced on the host: a new node, the old one stale.
	os.Remove(tf.path("d0/g"))
	os.WriteFile(tf.path("d0/g"), []byte("1"), 0o644)
	if n := tf.lookup(d, "g"); n.NodeId == g.NodeId || n.Attr.Size != 1 {
		t.Fatalf("replaced g: node %d (was %d), size %d", n.NodeId, g.NodeId, n.Attr.Size)
	}
	if errno := tf.lookupErr(d, "missing"); errno != syscall.ENOENT {
		t.Fatalf("missing: %v", errno)
	}
}

// A mount decided for handles with no mount fd (no inode of it held any
// more; only directories decide a mount, so this takes a mount id the
// kernel reused, here a file's bind mount given the decision by hand):
// a LOOKUP without an fd cannot make one, and looks the name up by fd.
func TestLookupByHandleMountWithoutFD(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: mount")
	}
	tf := newTestFS(t, Options{InodeFileHandles: FileHandlesPrefer})
	if !tf.useHandles {
		t.Skip("no file handles here")
	}
	src := filepath.Join(tf.base, "outside")
	must(t, os.WriteFile(src, []byte("bound"), 0o644))
	must(t, os.WriteFile(tf.path("b"), nil, 0o644))
	if err := unix.Mount(src, tf.path("b"), "", unix.MS_BIND, ""); err != nil {
		t.Skipf("bind mount: %v", err)
	}
	t.Cleanup(func() { unix.Unmount(tf.path("b"), unix.MNT_DETACH) })
	var st unix.Statx_t
	must(t, unix.Statx(unix.AT_FDCWD, tf.path("b"), unix.AT_SYMLINK_NOFOLLOW, unix.STATX_MNT_ID, &st))
	tf.setMountHandles(st.Mnt_id, true, "test", nil)
	for round := range 3 {
		e := tf.lookup(rootID, "b")
		if e.Attr.Size != 5 {
			t.Fatalf("round %d: size %d", round, e.Attr.Size)
		}
		if a := tf.getattr(e.NodeId); a.Size != 5 {
			t.Fatalf("round %d: getattr size %d", round, a.Size)
		}
		if i := tf.node(e.NodeId); i.mnt != nil {
			t.Fatalf("round %d: held by handle on a mount without a mount fd", round)
		}
		tf.Forget(e.NodeId, 1)
	}
	if s := tf.Stats(); s.Inodes != 0 || s.InodeFDs != tf.baseFDs {
		t.Fatalf("after forget: %+v (base %d)", s, tf.baseFDs)
	}
}

// An inode found by READDIRPLUS or CREATE (which open the object) and the
// same object found by a LOOKUP without an fd have one key: the LOOKUP
// finds the guest's node, not a second one (a revalidation that got
// another node id would make the guest drop its dentry).
func TestLookupByHandleSameNodeAsOpened(t *testing.T) {
	tf := newHandleFS(t, 16, 1)
	for _, n := range []string{"a", "b", "c"} {
		must(t, os.WriteFile(tf.path("d0/"+n), nil, 0o644))
	}
	d := tf.lookup(rootID, "d0").NodeId
	for _, e := range tf.readdirAll(d, true, 100) {
		if e.name == "." || e.name == ".." {
			continue
		}
		if got := tf.lookup(d, e.name).NodeId; got != e.entry.NodeId {
			t.Fatalf("%s: READDIRPLUS node %d, LOOKUP node %d", e.name, e.entry.NodeId, got)
		}
	}
	c := tf.create(d, "new", unix.O_RDWR, 0o644)
	tf.release(c.NodeId, c.Fh)
	if got := tf.lookup(d, "new").NodeId; got != c.NodeId {
		t.Fatalf("new: CREATE node %d, LOOKUP node %d", c.NodeId, got)
	}
}
