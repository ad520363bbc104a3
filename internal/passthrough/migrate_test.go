package passthrough

import (
	"bytes"
	"fmt"
	"hash/crc32"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"

	gofuse "github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"github.com/govirtiofsd/govirtiofsd/internal/passthrough/migstate"
)

// newDest returns a fresh file system over src's shared directory, as a
// migration destination is: no INIT.
func newDest(t *testing.T, src *testFS, opts Options) *testFS {
	t.Helper()
	return openTestFS(t, src.dir, src.base, opts)
}

// trailerMagic starts our trailer (package migstate's stream).
const trailerMagic = "GVFSTAIL"

// testSession stands for the FUSE server's session record, which the file
// system carries without reading it.
var testSession = []byte("the FUSE server's session record")

func save(t *testing.T, f *FS) []byte {
	t.Helper()
	var b bytes.Buffer
	if err := f.SaveState(&b, testSession); err != nil {
		t.Fatalf("SaveState: %v", err)
	}
	return b.Bytes()
}

// restoreCaps is a restore callback that installs caps, as the FUSE
// server does for a session record it accepts.
func restoreCaps(caps uint64) func([]byte, bool, uint64) (uint64, error) {
	return func([]byte, bool, uint64) (uint64, error) { return caps, nil }
}

// restoreArgs is what a LoadState passed its restore callback.
type restoreArgs struct {
	session    []byte
	mounted    bool
	negotiated uint64
	calls      int
}

// recordRestore returns a restore callback that records its arguments
// and installs caps.
func recordRestore(a *restoreArgs, caps uint64) func([]byte, bool, uint64) (uint64, error) {
	return func(session []byte, mounted bool, negotiated uint64) (uint64, error) {
		a.session, a.mounted, a.negotiated = session, mounted, negotiated
		a.calls++
		return caps, nil
	}
}

// record returns the record of node id in s, nil without one.
func record(s *migstate.State, id uint64) *migstate.Inode {
	for k := range s.Inodes {
		if s.Inodes[k].ID == id {
			return &s.Inodes[k]
		}
	}
	return nil
}

func decoded(t *testing.T, b []byte) *migstate.State {
	t.Helper()
	s, err := migstate.Decode(bytes.NewReader(b), migstate.MaxSize)
	if err != nil {
		t.Fatalf("decode: %v", err)
	}
	return s
}

// openFDs counts the process's open fds.
func openFDs(t *testing.T) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	return len(ents)
}

func (tf *testFS) nlookup(id uint64) uint64 {
	i := tf.nodes.get(id)
	if i == nil {
		tf.t.Fatalf("node %#x missing", id)
	}
	ks := &tf.keys[i.key.hash()%keyShards]
	ks.mu.Lock()
	defer ks.mu.Unlock()
	return i.nlookup
}

func (tf *testFS) ids() (nodes, handles []uint64) {
	tf.nodes.each(func(i *inode) { nodes = append(nodes, i.id) })
	tf.handles.each(func(h *handle) { handles = append(handles, h.id) })
	slices.Sort(nodes)
	slices.Sort(handles)
	return nodes, handles
}

// readdirFrom reads up to perCall entries of open directory fh from off.
func (tf *testFS) readdirFrom(node, fh, off uint64, perCall int) (names []string, next uint64) {
	tf.t.Helper()
	next = off
	in := &gofuse.ReadIn{InHeader: *hdr(node), Fh: fh, Offset: off, Size: 4096}
	errno := tf.ReadDir(in, false, func(name []byte, ino uint64, typ uint32, o uint64) (*gofuse.EntryOut, bool) {
		if len(names) == perCall {
			return nil, false
		}
		names = append(names, string(name))
		next = o
		return nil, true
	})
	if errno != 0 {
		tf.t.Fatalf("readdir: %v", errno)
	}
	return names, next
}

func TestMigrateRoundTrip(t *testing.T) {
	src := newTestFS(t, Options{Writeback: true, PosixLocks: true, Flock: true})
	os.Mkdir(src.path("d"), 0o755)
	var want []string
	for k := range 20 {
		n := fmt.Sprintf("e%02d", k)
		os.WriteFile(src.path("d/"+n), nil, 0o644)
		want = append(want, n)
	}
	os.WriteFile(src.path("d/f"), []byte("hello"), 0o644)
	want = append(want, "f", ".", "..")
	slices.Sort(want)
	os.Symlink("f", src.path("d/l"))
	want = append(want, "l")
	unix.Mkfifo(src.path("fifo"), 0o644)

	d := src.lookup(rootID, "d").NodeId
	src.lookup(rootID, "d")
	f := src.lookup(d, "f").NodeId
	l := src.lookup(d, "l").NodeId
	fifo := src.lookup(rootID, "fifo").NodeId
	fh := src.open(f, unix.O_RDWR)
	rofh := src.open(f, unix.O_RDONLY)
	dfh := src.opendir(d)
	rootfh := src.opendir(rootID)
	first, off := src.readdirFrom(d, dfh, 0, 5)
	// Locks are dropped (and logged), not migrated.
	if errno := src.SetLk(&gofuse.LkIn{InHeader: *hdr(f), Fh: fh, Owner: 1, Lk: gofuse.FileLock{Typ: unix.F_WRLCK, End: 9}}, false); errno != 0 {
		t.Fatal(errno)
	}
	if errno := src.SetLk(&gofuse.LkIn{InHeader: *hdr(f), Fh: rofh, LkFlags: gofuse.LK_FLOCK, Lk: gofuse.FileLock{Typ: unix.F_RDLCK}}, false); errno != 0 {
		t.Fatal(errno)
	}

	src.PrepareMigration()
	b := save(t, src.FS)
	src.CancelMigration()
	s := decoded(t, b)
	paths := map[uint64]string{}
	for _, r := range s.Inodes {
		if r.Loc != migstate.LocFullPath && r.ID != rootID {
			t.Fatalf("record %+v", r)
		}
		paths[r.ID] = r.Path
	}
	if paths[d] != "d" || paths[f] != "d/f" || paths[l] != "d/l" || paths[fifo] != "fifo" {
		t.Fatalf("paths %v", paths)
	}
	if r := record(s, d); r.Refcount != 2 || r.Type != unix.S_IFDIR {
		t.Fatalf("record of d %+v", r)
	}
	if r := record(s, rootID); r.Loc != migstate.LocRoot || r.Refcount != rootRefcount || len(s.Inodes) != 5 {
		t.Fatalf("root record %+v of %d", r, len(s.Inodes))
	}
	if !s.Ours || !bytes.Equal(s.Session, testSession) || !s.V2 || !s.Opts.Writeback || !s.Opts.SuppGroups ||
		s.Opts.PosixACL || s.Opts.AnnounceSubmounts {
		t.Fatalf("state %+v", s)
	}

	dst := newDest(t, src, Options{Writeback: true, PosixLocks: true, Flock: true})
	caps := src.caps.Load()
	if err := dst.LoadState(bytes.NewReader(b), restoreCaps(caps)); err != nil {
		t.Fatalf("LoadState: %v", err)
	}
	sn, sh := src.ids()
	dn, dh := dst.ids()
	if !slices.Equal(sn, dn) || !slices.Equal(sh, dh) {
		t.Fatalf("ids differ: nodes %x / %x, handles %x / %x", sn, dn, sh, dh)
	}
	for _, id := range sn {
		if a, b := src.nlookup(id), dst.nlookup(id); a != b {
			t.Fatalf("node %#x: nlookup %d on the source, %d here", id, a, b)
		}
	}
	if !dst.initDone || dst.caps.Load() != caps || !dst.writeback.Load() {
		t.Fatalf("session not restored: init %v caps %#x writeback %v", dst.initDone, dst.caps.Load(), dst.writeback.Load())
	}
	if st := dst.Stats(); st.Inodes != 4 || st.Handles != 4 || st.LockFDs != 0 {
		t.Fatalf("stats %+v", st)
	}

	// Everything works through the same ids.
	if a := dst.getattr(f); a.Size != 5 {
		t.Fatalf("size %d", a.Size)
	}
	if got := dst.read(f, fh, 0, 5); string(got) != "hello" {
		t.Fatalf("read %q", got)
	}
	dst.write(f, fh, 5, []byte(" world"), 0)
	if got := dst.read(f, rofh, 0, 64); string(got) != "hello world" {
		t.Fatalf("read after write %q", got)
	}
	var lnk [64]byte
	if n, errno := dst.Readlink(hdr(l), lnk[:]); errno != 0 || string(lnk[:n]) != "f" {
		t.Fatalf("readlink %q %v", lnk[:n], errno)
	}
	// The directory handle goes on at the guest's offset on a fresh fd.
	rest, _ := dst.readdirFrom(d, dfh, off, 1000)
	got := append(first, rest...)
	slices.Sort(got)
	if !slices.Equal(got, want) {
		t.Fatalf("readdir across the migration: %q, want %q", got, want)
	}
	if names, _ := dst.readdirFrom(rootID, rootfh, 0, 1000); len(names) != 4 {
		t.Fatalf("root listing %q", names)
	}
	// New objects get ids that collide with none restored.
	checkNewIDs(t, dst, 200, sn, sh)
	// RELEASE and FORGET free the restored objects.
	dst.release(f, fh)
	dst.release(f, rofh)
	dst.ReleaseDir(&gofuse.ReleaseIn{InHeader: *hdr(d), Fh: dfh})
	dst.ReleaseDir(&gofuse.ReleaseIn{InHeader: *hdr(rootID), Fh: rootfh})
	dst.Forget(d, 2)
	for _, id := range []uint64{f, l, fifo} {
		dst.Forget(id, 1)
	}
	if st := dst.Stats(); st != (Stats{InodeFDs: dst.baseFDs}) {
		t.Fatalf("after release and forget: %+v", st)
	}
}

// A rename on the host between the collection of paths and the save is
// followed only with ConfirmPaths.
func TestMigrateHostRename(t *testing.T) {
	for _, confirm := range []bool{false, true} {
		t.Run(fmt.Sprint("confirm=", confirm), func(t *testing.T) {
			src := newTestFS(t, Options{Migration: MigrationOptions{ConfirmPaths: confirm}})
			os.Mkdir(src.path("a"), 0o755)
			os.WriteFile(src.path("a/old"), []byte("x"), 0o644)
			a := src.lookup(rootID, "a").NodeId
			n := src.lookup(a, "old").NodeId
			src.PrepareMigration()
			<-src.mig.cur.done
			if err := os.Rename(src.path("a/old"), src.path("new")); err != nil {
				t.Fatal(err)
			}
			// An inode made after the collection started gets its
			// path at save.
			os.WriteFile(src.path("late"), nil, 0o644)
			late := src.lookup(rootID, "late").NodeId
			b := save(t, src.FS)
			paths := map[uint64]string{}
			for _, r := range decoded(t, b).Inodes {
				paths[r.ID] = r.Path
			}
			want := "a/old"
			if confirm {
				want = "new"
			}
			if paths[n] != want || paths[late] != "late" {
				t.Fatalf("paths %v, want %q for node %#x", paths, want, n)
			}

			dst := newDest(t, src, Options{})
			err := dst.LoadState(bytes.NewReader(b), restoreCaps(src.caps.Load()))
			if !confirm {
				if err == nil || !strings.Contains(err.Error(), "a/old") {
					t.Fatalf("LoadState of a path gone: %v", err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			dst.getattr(n)
		})
	}
}

// An open file unlinked on the host has no path: the destination aborts,
// or installs it stale.
func TestMigrateUnreachable(t *testing.T) {
	mk := func(t *testing.T) (*testFS, []byte, uint64, uint64, uint64, uint64) {
		src := newTestFS(t, Options{PosixLocks: true, Flock: true})
		os.WriteFile(src.path("u"), []byte("x"), 0o644)
		os.Mkdir(src.path("gone"), 0o755)
		os.WriteFile(src.path("keep"), []byte("k"), 0o644)
		u := src.lookup(rootID, "u").NodeId
		fh := src.open(u, unix.O_RDWR)
		gone := src.lookup(rootID, "gone").NodeId
		keep := src.lookup(rootID, "keep").NodeId
		os.Remove(src.path("u"))
		os.Remove(src.path("gone"))
		b := save(t, src.FS)
		for _, r := range decoded(t, b).Inodes {
			if (r.ID == u || r.ID == gone) != (r.Loc == migstate.LocInvalid) {
				t.Fatalf("record %+v", r)
			}
		}
		return src, b, u, fh, gone, keep
	}

	t.Run("abort", func(t *testing.T) {
		src, b, _, _, _, _ := mk(t)
		dst := newDest(t, src, Options{})
		// The destination's own session stays as it was.
		dst.Init(dst.Capabilities())
		prev := dst.lookup(rootID, "keep").NodeId
		pfh := dst.open(prev, unix.O_RDONLY)
		before, stats := openFDs(t), dst.Stats()
		err := dst.LoadState(bytes.NewReader(b), restoreCaps(src.caps.Load()))
		if err == nil || !strings.Contains(err.Error(), "unreachable") {
			t.Fatalf("LoadState: %v", err)
		}
		if n := openFDs(t); n != before || dst.Stats() != stats {
			t.Fatalf("fds %d → %d, stats %+v → %+v", before, n, stats, dst.Stats())
		}
		if got := dst.read(prev, pfh, 0, 1); string(got) != "k" {
			t.Fatalf("previous session broken: %q", got)
		}
	})

	t.Run("guest-error", func(t *testing.T) {
		src, b, u, fh, gone, keep := mk(t)
		dst := newDest(t, src, Options{PosixLocks: true, Flock: true, Migration: MigrationOptions{OnError: MigrationGuestError}})
		if err := dst.LoadState(bytes.NewReader(b), restoreCaps(src.caps.Load())); err != nil {
			t.Fatal(err)
		}
		if got := dst.getattr(keep); got.Size != 1 {
			t.Fatalf("reachable inode: %+v", got)
		}
		checkStale(t, dst, u, fh, gone, keep)
		dst.release(u, fh)
		dst.Forget(u, 1)
		dst.Forget(gone, 1)
		dst.Forget(keep, 1)
		if st := dst.Stats(); st != (Stats{InodeFDs: dst.baseFDs}) {
			t.Fatalf("after release and forget: %+v", st)
		}
		// Nothing is left but the root.
		for _, r := range decoded(t, save(t, dst.FS)).Inodes {
			if r.ID != rootID {
				t.Fatalf("left over %+v", r)
			}
		}
	})
}

// checkNewIDs creates, looks up, opens and lets go of n new files in f's
// root: no node or handle id they get may be one of the restored ones.
func checkNewIDs(t *testing.T, f *testFS, n int, nodes, handles []uint64) {
	t.Helper()
	for k := range n {
		name := fmt.Sprintf("n%d", k)
		os.WriteFile(f.path(name), nil, 0o644)
		e := f.lookup(rootID, name)
		h := f.open(e.NodeId, unix.O_RDONLY)
		if slices.Contains(nodes, e.NodeId) || slices.Contains(handles, h) {
			t.Fatalf("new id collides: node %#x handle %#x", e.NodeId, h)
		}
		f.release(e.NodeId, h)
		f.Forget(e.NodeId, 1)
	}
}

// checkStale: every request on stale file u (open as fh) and stale
// directory gone answers ESTALE; keep is a live regular file.
func checkStale(t *testing.T, f *testFS, u, fh, gone, keep uint64) {
	t.Helper()
	var eo gofuse.EntryOut
	var ao gofuse.AttrOut
	var oo gofuse.OpenOut
	var co gofuse.CreateOut
	var so gofuse.StatfsOut
	var xo gofuse.StatxOut
	var lo gofuse.LseekOut
	var lk gofuse.LkOut
	buf := make([]byte, 16)
	h := func(n uint64) gofuse.InHeader { return *hdr(n) }
	calls := map[string]func() syscall.Errno{
		"getattr": func() syscall.Errno { return f.GetAttr(&gofuse.GetAttrIn{InHeader: h(u)}, &ao) },
		"getattr fh": func() syscall.Errno {
			return f.GetAttr(&gofuse.GetAttrIn{InHeader: h(u), Flags_: gofuse.FUSE_GETATTR_FH, Fh_: fh}, &ao)
		},
		"setattr": func() syscall.Errno {
			return f.SetAttr(&gofuse.SetAttrIn{SetAttrInCommon: gofuse.SetAttrInCommon{InHeader: h(u)}}, &ao)
		},
		"setattr fh": func() syscall.Errno {
			return f.SetAttr(&gofuse.SetAttrIn{SetAttrInCommon: gofuse.SetAttrInCommon{InHeader: h(u), Valid: gofuse.FATTR_FH, Fh: fh}}, &ao)
		},
		"statx":         func() syscall.Errno { return f.Statx(&gofuse.StatxIn{InHeader: h(u)}, &xo) },
		"lookup":        func() syscall.Errno { return f.Lookup(hdr(gone), []byte("x"), &eo) },
		"lookup dotdot": func() syscall.Errno { return f.Lookup(hdr(gone), []byte(".."), &eo) },
		"mkdir": func() syscall.Errno {
			return f.Mkdir(&gofuse.MkdirIn{InHeader: h(gone)}, noGroup, nil, []byte("x"), &eo)
		},
		"mkdir in file": func() syscall.Errno { return f.Mkdir(&gofuse.MkdirIn{InHeader: h(u)}, noGroup, nil, []byte("x"), &eo) },
		"create": func() syscall.Errno {
			return f.Create(&gofuse.CreateIn{InHeader: h(gone)}, noGroup, nil, []byte("x"), &co)
		},
		"tmpfile":     func() syscall.Errno { return f.Tmpfile(&gofuse.CreateIn{InHeader: h(gone)}, noGroup, nil, &co) },
		"unlink":      func() syscall.Errno { return f.Unlink(hdr(gone), []byte("x")) },
		"rename from": func() syscall.Errno { return f.Rename(hdr(gone), rootID, 0, []byte("x"), []byte("y")) },
		"rename to":   func() syscall.Errno { return f.Rename(hdr(rootID), gone, 0, []byte("keep"), []byte("y")) },
		"link": func() syscall.Errno {
			return f.Link(&gofuse.LinkIn{InHeader: h(rootID), Oldnodeid: u}, []byte("y"), &eo)
		},
		"link into": func() syscall.Errno {
			return f.Link(&gofuse.LinkIn{InHeader: h(gone), Oldnodeid: keep}, []byte("y"), &eo)
		},
		"readlink": func() syscall.Errno { _, e := f.Readlink(hdr(u), buf); return e },
		"open":     func() syscall.Errno { return f.Open(&gofuse.OpenIn{InHeader: h(u)}, &oo) },
		"opendir":  func() syscall.Errno { return f.OpenDir(&gofuse.OpenIn{InHeader: h(gone)}, &oo) },
		"read": func() syscall.Errno {
			_, e := f.Read(&gofuse.ReadIn{InHeader: h(u), Fh: fh, Size: 1}, vecOver(buf))
			return e
		},
		"write": func() syscall.Errno {
			_, e := f.Write(&gofuse.WriteIn{InHeader: h(u), Fh: fh, Size: 1}, vecOver(buf[:1]))
			return e
		},
		"flush":     func() syscall.Errno { return f.Flush(&gofuse.FlushIn{InHeader: h(u), Fh: fh}) },
		"fsync":     func() syscall.Errno { return f.Fsync(&gofuse.FsyncIn{InHeader: h(u), Fh: fh}) },
		"fallocate": func() syscall.Errno { return f.Fallocate(&gofuse.FallocateIn{InHeader: h(u), Fh: fh, Length: 1}) },
		"lseek":     func() syscall.Errno { return f.Lseek(&gofuse.LseekIn{InHeader: h(u), Fh: fh}, &lo) },
		"copy_file_range": func() syscall.Errno {
			_, e := f.CopyFileRange(&gofuse.CopyFileRangeIn{InHeader: h(u), FhIn: fh, NodeIdOut: u, FhOut: fh, Len: 1}, ^uint64(0))
			return e
		},
		"statfs": func() syscall.Errno { return f.StatFs(hdr(u), &so) },
		"access": func() syscall.Errno { return f.Access(&gofuse.AccessIn{InHeader: h(u), Mask: unix.R_OK}) },
		"syncfs": func() syscall.Errno { return f.SyncFs(hdr(u)) },
		"getlk":  func() syscall.Errno { return f.GetLk(&gofuse.LkIn{InHeader: h(u), Fh: fh}, &lk) },
		"setlk": func() syscall.Errno {
			return f.SetLk(&gofuse.LkIn{InHeader: h(u), Fh: fh, Lk: gofuse.FileLock{Typ: unix.F_WRLCK}}, false)
		},
		"flock": func() syscall.Errno {
			return f.SetLk(&gofuse.LkIn{InHeader: h(u), Fh: fh, LkFlags: gofuse.LK_FLOCK, Lk: gofuse.FileLock{Typ: unix.F_WRLCK}}, false)
		},
		"fsyncdir":  func() syscall.Errno { return f.FsyncDir(&gofuse.FsyncIn{InHeader: h(u), Fh: fh}) },
		"readdir":   func() syscall.Errno { return f.ReadDir(&gofuse.ReadIn{InHeader: h(u), Fh: fh}, true, nil) },
		"listxattr": func() syscall.Errno { _, e := f.ListXAttr(hdr(u), buf); return e },
	}
	for name, call := range calls {
		errno := call()
		// A file handle used as a directory one is not a directory
		// handle at all.
		want := syscall.ESTALE
		if name == "fsyncdir" || name == "readdir" {
			want = syscall.EBADF
		}
		if name == "listxattr" {
			want = syscall.ENOSYS // no xattr option: refused before the inode
		}
		if errno != want {
			t.Errorf("%s on a stale object: %v, want %v", name, errno, want)
		}
	}
	// Nothing made anything on the host.
	if _, err := os.Lstat(f.path("y")); err == nil {
		t.Error("a stale object's request made y")
	}
}

// A handle that cannot be reopened (here: for writing, on a read-only
// destination) is stale on a live inode.
func TestMigrateStaleHandle(t *testing.T) {
	src := newTestFS(t, Options{})
	os.WriteFile(src.path("f"), []byte("abc"), 0o644)
	f := src.lookup(rootID, "f").NodeId
	wfh := src.open(f, unix.O_RDWR)
	rfh := src.open(f, unix.O_RDONLY)
	b := save(t, src.FS)
	ro := newDest(t, src, Options{ReadOnly: true})
	loadFails(t, ro, b, "read-only")
	dst := newDest(t, src, Options{ReadOnly: true, Migration: MigrationOptions{OnError: MigrationGuestError}})
	if err := dst.LoadState(bytes.NewReader(b), restoreCaps(src.caps.Load())); err != nil {
		t.Fatal(err)
	}
	if got := dst.read(f, rfh, 0, 3); string(got) != "abc" {
		t.Fatalf("read %q", got)
	}
	var ao gofuse.AttrOut
	var xo gofuse.StatxOut
	if errno := dst.GetAttr(&gofuse.GetAttrIn{InHeader: *hdr(f), Flags_: gofuse.FUSE_GETATTR_FH, Fh_: wfh}, &ao); errno != syscall.ESTALE {
		t.Fatalf("getattr fh: %v", errno)
	}
	if errno := dst.Statx(&gofuse.StatxIn{InHeader: *hdr(f), GetattrFlags: gofuse.FUSE_GETATTR_FH, Fh: wfh}, &xo); errno != syscall.ESTALE {
		t.Fatalf("statx fh: %v", errno)
	}
	in := &gofuse.SetAttrIn{SetAttrInCommon: gofuse.SetAttrInCommon{InHeader: *hdr(f), Valid: gofuse.FATTR_FH, Fh: wfh}}
	if errno := dst.SetAttr(in, &ao); errno != syscall.ESTALE {
		t.Fatalf("setattr fh: %v", errno)
	}
	if _, errno := dst.Read(&gofuse.ReadIn{InHeader: *hdr(f), Fh: wfh, Size: 1}, vecOver(make([]byte, 1))); errno != syscall.ESTALE {
		t.Fatalf("read: %v", errno)
	}
	dst.getattr(f)
	dst.release(f, wfh)
	dst.release(f, rfh)
	dst.Forget(f, 1)
	if st := dst.Stats(); st != (Stats{InodeFDs: dst.baseFDs}) {
		t.Fatalf("after release and forget: %+v", st)
	}
}

// A session that holds nothing but the root, and one that was never
// mounted (no root either: the Rust daemon's state before INIT), which
// leaves the destination without a session.
func TestMigrateNoInodes(t *testing.T) {
	src := newTestFS(t, Options{})
	b := save(t, src.FS)
	if s := decoded(t, b); len(s.Inodes) != 1 || s.Inodes[0].Loc != migstate.LocRoot || len(s.Handles) != 0 || s.NextInode != 2 {
		t.Fatalf("%+v", s)
	}
	dst := newDest(t, src, Options{})
	var a restoreArgs
	if err := dst.LoadState(bytes.NewReader(b), recordRestore(&a, dst.Capabilities())); err != nil {
		t.Fatal(err)
	}
	if !a.mounted || !dst.initDone {
		t.Fatalf("restore %+v, init %v", a, dst.initDone)
	}
	dst.lookupErr(rootID, "x")

	src.Destroy()
	b = save(t, src.FS)
	if s := decoded(t, b); len(s.Inodes) != 0 || len(s.Handles) != 0 || s.Opts != (migstate.Negotiated{}) {
		t.Fatalf("%+v", s)
	}
	if err := dst.LoadState(bytes.NewReader(b), recordRestore(&a, 0)); err != nil {
		t.Fatal(err)
	}
	if a.mounted || dst.initDone || a.calls != 2 {
		t.Fatalf("restore %+v, init %v", a, dst.initDone)
	}
}

// The path collection can be cancelled and restarted, and Close stops it.
func TestMigrateCollection(t *testing.T) {
	src := newTestFS(t, Options{})
	for k := range 50 {
		os.WriteFile(src.path(fmt.Sprint(k)), nil, 0o644)
		src.lookup(rootID, fmt.Sprint(k))
	}
	src.PrepareMigration()
	src.PrepareMigration() // a second LOG_ALL: the same collection
	src.CancelMigration()
	src.CancelMigration()
	if src.mig.cur != nil {
		t.Fatal("collection left after cancel")
	}
	src.PrepareMigration()
	c := src.mig.cur
	<-c.done
	if len(c.paths) != 50 {
		t.Fatalf("%d paths", len(c.paths))
	}
	if s := decoded(t, save(t, src.FS)); len(s.Inodes) != 51 {
		t.Fatalf("%d inodes", len(s.Inodes))
	}
	src.PrepareMigration()
	src.Close()
}

// Without a usable /proc link (a path whose link says nothing), the search
// of the share finds the objects.
func TestMigrateSearchShare(t *testing.T) {
	src := newTestFS(t, Options{})
	os.MkdirAll(src.path("a/b/c"), 0o755)
	os.WriteFile(src.path("a/b/c/f"), nil, 0o644)
	os.WriteFile(src.path("a/g"), nil, 0o644)
	os.Symlink("b", src.path("a/s"))
	a := src.lookup(rootID, "a").NodeId
	b := src.lookup(a, "b").NodeId
	c := src.lookup(b, "c").NodeId
	f := src.lookup(c, "f").NodeId
	g := src.lookup(a, "g").NodeId
	s := src.lookup(a, "s").NodeId
	var ins []*inode
	for _, id := range []uint64{a, b, c, f, g, s} {
		ins = append(ins, src.nodes.get(id))
	}
	paths := map[*inode]string{}
	if !src.searchShare(ins, paths, nil) {
		t.Fatal("search stopped")
	}
	want := []string{"a", "a/b", "a/b/c", "a/b/c/f", "a/g", "a/s"}
	for k, i := range ins {
		if paths[i] != want[k] {
			t.Fatalf("node %d: %q, want %q", k, paths[i], want[k])
		}
	}
	stop := make(chan struct{})
	close(stop)
	if src.searchShare(ins, map[*inode]string{}, stop) {
		t.Fatal("search not stopped")
	}
}

func TestRelLink(t *testing.T) {
	tests := []struct {
		link, root, want string
		ok               bool
	}{
		{"/a/b", "/", "a/b", true},
		{"/srv/share/a/b", "/srv/share", "a/b", true},
		{"/srv/share", "/srv/share", "", false},
		{"/srv/shared/a", "/srv/share", "", false},
		{"/srv/other", "/srv/share", "", false},
		{"/a/b (deleted)", "/", "", false},
		{"pipe:[1234]", "/", "", false},
		{"/", "/", "", false},
		{"/a//b", "/", "", false},
		{"/a/../b", "/", "", false},
		{"/" + strings.Repeat("x", 256), "/", "", false},
	}
	for _, tc := range tests {
		got, ok := relLink(tc.link, tc.root)
		if got != tc.want || ok != tc.ok {
			t.Errorf("relLink(%q, %q) = %q, %v; want %q, %v", tc.link, tc.root, got, ok, tc.want, tc.ok)
		}
	}
}

// smallState is a valid state of src: a directory, a file in it and a
// handle of each.
func smallState(t *testing.T) (*testFS, []byte) {
	src := newTestFS(t, Options{})
	os.Mkdir(src.path("d"), 0o755)
	os.WriteFile(src.path("d/f"), []byte("x"), 0o644)
	d := src.lookup(rootID, "d").NodeId
	f := src.lookup(d, "f").NodeId
	src.open(f, unix.O_RDWR)
	src.opendir(d)
	return src, save(t, src.FS)
}

// reencode writes s as it is, with its checksum fixed up: also records
// migstate.Encode would refuse, to see the decoder and LoadState refuse them.
func reencode(t *testing.T, s *migstate.State) []byte {
	t.Helper()
	var b bytes.Buffer
	if err := migstate.EncodeUnchecked(&b, s); err != nil {
		t.Fatal(err)
	}
	return b.Bytes()
}

// loadFails loads b into dst, which must refuse it and stay as it was:
// no fd leaked, its own session intact.
func loadFails(t *testing.T, dst *testFS, b []byte, want string) {
	t.Helper()
	before, stats := openFDs(t), dst.Stats()
	nodes, handles := dst.ids()
	err := dst.LoadState(bytes.NewReader(b), restoreCaps(0))
	if err == nil {
		t.Fatalf("LoadState accepted it")
	}
	if want != "" && !strings.Contains(err.Error(), want) {
		t.Fatalf("LoadState: %v; want %q", err, want)
	}
	n2, h2 := dst.ids()
	if n := openFDs(t); n != before || dst.Stats() != stats || !slices.Equal(nodes, n2) || !slices.Equal(handles, h2) {
		t.Fatalf("after a failed load: fds %d → %d, stats %+v → %+v", before, n, stats, dst.Stats())
	}
}

func TestLoadStateBadStreams(t *testing.T) {
	src, good := smallState(t)
	dst := newDest(t, src, Options{Migration: MigrationOptions{OnError: MigrationGuestError}})
	dst.Init(dst.Capabilities())
	keep := dst.lookup(rootID, "d").NodeId
	dst.opendir(keep)

	s0 := decoded(t, good)
	msg := messageOnly(t, s0)
	for n := range len(good) {
		if n == len(msg) {
			continue // the message alone is a Rust daemon's stream
		}
		loadFails(t, dst, good[:n], "")
	}
	loadFails(t, dst, append(slices.Clone(good), 0), "bytes after the trailer")
	loadFails(t, dst, []byte("GVFSFUSE\x01\x00\x00\x00"), "not a virtiofsd migration state")
	loadFails(t, dst, append(slices.Clone(msg), "GVFSTAIX"...), "not a govirtiofsd trailer")
	loadFails(t, dst, append(slices.Clone(msg), 0), "not a govirtiofsd trailer")
	v2 := slices.Clone(good)
	v2[len(msg)+8] = 2
	loadFails(t, dst, v2, "trailer version 2 is not supported")
	bad := slices.Clone(good)
	bad[len(bad)-10] ^= 1
	loadFails(t, dst, bad, "checksum")
	bad = slices.Clone(good)
	bad[3] ^= 1 // the message is under the checksum too
	loadFails(t, dst, bad, "")
	for seed := range 64 {
		junk := make([]byte, 1+seed*37)
		for k := range junk {
			junk[k] = byte(k*131 + seed*7)
		}
		loadFails(t, dst, junk, "")
		loadFails(t, dst, append(slices.Clone(msg), junk...), "")
	}
	// Counts beyond the bounds are refused before anything is allocated.
	loadFails(t, dst, []byte{1, 0xff, 0xff, 0xff, 0xff, 0x0f}, "inode count")
	loadFails(t, dst, []byte{1, 0, 2, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x01}, "handle count")
	huge := append(slices.Clone(msg), trailerMagic+"\x01\x00\x00\x00\xff\xff\xff\xff"...)
	loadFails(t, dst, huge, "session record of")
	// The size bound.
	if _, err := migstate.Decode(bytes.NewReader(good), int64(len(good)-1)); err == nil || !strings.Contains(err.Error(), "too large") {
		t.Fatalf("size bound: %v", err)
	}

	// Well-formed streams whose records are wrong.
	var dirID, fileID uint64
	for _, r := range s0.Inodes {
		switch r.Type {
		case unix.S_IFDIR:
			if r.ID != rootID {
				dirID = r.ID
			}
		default:
			fileID = r.ID
		}
	}
	at := func(s *migstate.State, id uint64) *migstate.Inode { return record(s, id) }
	edits := []struct {
		name string
		edit func(s *migstate.State)
		want string
	}{
		{"dup node", func(s *migstate.State) { at(s, fileID).ID = dirID }, "duplicate node id"},
		{"node 0", func(s *migstate.State) { at(s, fileID).ID = 0 }, "reserved"},
		{"root id on a path", func(s *migstate.State) { at(s, fileID).ID = rootID }, "the root is node 1"},
		{"root location elsewhere", func(s *migstate.State) { at(s, fileID).Loc = migstate.LocRoot }, "the root is node 1"},
		{"no root", func(s *migstate.State) { s.Inodes = s.Inodes[1:] }, "without the root"},
		{"root refcount", func(s *migstate.State) { at(s, rootID).Refcount = 0 }, "refcount 0 below"},
		{"bad type", func(s *migstate.State) { at(s, fileID).Type = 0o170000 }, "bad file type"},
		{"dotdot", func(s *migstate.State) { at(s, fileID).Path = "../x" }, `".." component`},
		{"absolute", func(s *migstate.State) { at(s, fileID).Path = "/etc" }, "absolute"},
		{"nul", func(s *migstate.State) { at(s, fileID).Path = "d\x00" }, "NUL"},
		{"empty comp", func(s *migstate.State) { at(s, fileID).Path = "d//f" }, "empty component"},
		{"empty", func(s *migstate.State) { at(s, fileID).Path = "" }, "empty path"},
		{"parent missing", func(s *migstate.State) {
			r := at(s, fileID)
			r.Loc, r.Parent, r.Path = migstate.LocPath, 77<<32, "f"
		}, "parent 0x4d00000000 is missing"},
		{"parent a file", func(s *migstate.State) {
			r := at(s, dirID)
			r.Loc, r.Parent, r.Path = migstate.LocPath, fileID, "d"
		}, "is of type"},
		{"parent cycle", func(s *migstate.State) {
			r := at(s, dirID)
			r.Loc, r.Parent, r.Path = migstate.LocPath, dirID, "d"
		}, "its own parent"},
		{"refcount below children", func(s *migstate.State) {
			r := at(s, fileID)
			r.Loc, r.Parent, r.Path = migstate.LocPath, dirID, "f"
			at(s, dirID).Refcount = 0
		}, "refcount 0 below its 1 child"},
		{"empty handle", func(s *migstate.State) {
			r := at(s, fileID)
			r.Loc, r.Handle = migstate.LocFileHandle, migstate.FileHandle{}
		}, "file handle of 0 bytes"},
		{"dup mount", func(s *migstate.State) {
			s.MountPaths = []migstate.MountPath{{MountID: 1, Path: "."}, {MountID: 1, Path: "d"}}
		}, "given twice"},
		{"mount path", func(s *migstate.State) { s.MountPaths = []migstate.MountPath{{MountID: 1, Path: "../x"}} }, `".." component`},
		{"dup handle", func(s *migstate.State) { s.Handles[1].ID = s.Handles[0].ID }, "duplicate file handle"},
		{"orphan handle", func(s *migstate.State) { s.Handles[0].Inode = 77 << 32 }, "is missing"},
		{"handle of a path-only inode", func(s *migstate.State) {
			r := at(s, fileID)
			r.Loc, r.Parent, r.Path = migstate.LocPath, dirID, "f"
			at(s, dirID).Refcount = 1 // the child's reference only
		}, "has no lookup"},
		{"dir handle on file", func(s *migstate.State) {
			for k := range s.Handles {
				s.Handles[k].Inode, s.Handles[k].Dir = fileID, true
			}
		}, "directory handle"},
		{"writeback off here", func(s *migstate.State) { s.Opts.Writeback = true }, "writeback"},
		{"submounts off here", func(s *migstate.State) { s.Opts.AnnounceSubmounts = true }, "announces submounts"},
		{"acl off here", func(s *migstate.State) { s.Opts.PosixACL = true }, "POSIX ACLs"},
		{"escape by symlink", func(s *migstate.State) {
			os.Symlink("..", src.path("up"))
			at(s, dirID).Path = "up/share/d"
		}, ""},
	}
	for _, tc := range edits {
		t.Run(tc.name, func(t *testing.T) {
			s := decoded(t, good)
			tc.edit(s)
			b := reencode(t, s)
			if tc.want == "" {
				// Path does not open: with guest-error it installs stale.
				ab := newDest(t, src, Options{})
				loadFails(t, ab, b, "open")
				return
			}
			loadFails(t, dst, b, tc.want)
		})
	}
	// And the good one still loads.
	if err := dst.LoadState(bytes.NewReader(good), restoreCaps(0)); err != nil {
		t.Fatal(err)
	}
}

// messageOnly is the Rust message of s, without our trailer: what a Rust
// virtiofsd would write for it.
func messageOnly(t *testing.T, s *migstate.State) []byte {
	t.Helper()
	c := *s
	c.Ours = false
	return reencode(t, &c)
}

// A state's path may name a symlink (the object), but never go through one.
func TestLoadStateTypeMismatch(t *testing.T) {
	src, good := smallState(t)
	s := decoded(t, good)
	// The file was replaced by a directory on the host.
	os.Remove(src.path("d/f"))
	os.Mkdir(src.path("d/f"), 0o755)
	dst := newDest(t, src, Options{})
	loadFails(t, dst, reencode(t, s), "type")
	ge := newDest(t, src, Options{Migration: MigrationOptions{OnError: MigrationGuestError}})
	if err := ge.LoadState(bytes.NewReader(good), restoreCaps(0)); err != nil {
		t.Fatal(err)
	}
	for _, r := range s.Inodes {
		if i := ge.nodes.get(r.ID); r.ID != rootID && (i == nil || i.stale != (r.Type == unix.S_IFREG)) {
			t.Fatalf("node %+v: %+v", r, i)
		}
	}
}

// rustSeeds are states as the Rust daemon writes them (no trailer), for
// the fuzz targets: paths below parents, file handles with mount paths,
// handle id 0, ids above 2^32, V1.
func rustSeeds() []*migstate.State {
	root := migstate.Inode{ID: rootID, Refcount: 3, Loc: migstate.LocRoot}
	return []*migstate.State{
		{V2: true, NextInode: 5, NextHandle: 2, Opts: migstate.Negotiated{AnnounceSubmounts: true, SuppGroups: true},
			Inodes: []migstate.Inode{root,
				{ID: 2, Refcount: 2, Loc: migstate.LocPath, Parent: rootID, Path: "d"},
				{ID: 3, Refcount: 1, Loc: migstate.LocPath, Parent: 2, Path: "f"},
				{ID: 4, Refcount: 1, Loc: migstate.LocInvalid}},
			Handles: []migstate.Handle{{ID: 0, Inode: 3, Flags: unix.O_RDWR}, {ID: 1, Inode: 2, Flags: unix.O_DIRECTORY}}},
		{V2: true, NextInode: 1<<32 + 3, NextHandle: 1,
			Inodes: []migstate.Inode{{ID: rootID, Refcount: 2, Loc: migstate.LocRoot},
				{ID: 1<<32 + 2, Refcount: 1, Loc: migstate.LocFileHandle, Handle: migstate.FileHandle{MountID: 30, Type: 1, Bytes: make([]byte, 8)}},
				{ID: 3, Refcount: 1, Loc: migstate.LocFullPath, Path: "d/f",
					Verify: &migstate.FileHandle{MountID: 30, Type: 1, Bytes: make([]byte, 8)}}},
			MountPaths: []migstate.MountPath{{MountID: 30, Path: "."}, {MountID: 31, Path: "d"}},
			Handles:    []migstate.Handle{{ID: 0, Inode: 1<<32 + 2}}},
		{NextInode: 3, Inodes: []migstate.Inode{root, {ID: 2, Refcount: 1, Loc: migstate.LocPath, Parent: rootID, Path: "up/share"}}},
	}
}

// FuzzLoadState: whatever the stream, LoadState returns (an error or not),
// never panics, and a failed load leaves no fd open and the tables as they
// were. With fixCRC the trailer's checksum is recomputed, so that the
// fuzzer reaches validation and reopening. The seeds cover both formats:
// ours, and the Rust daemon's (every location kind, V1 and V2).
func FuzzLoadState(f *testing.F) {
	base := f.TempDir()
	share := filepath.Join(base, "share")
	os.MkdirAll(filepath.Join(share, "d"), 0o755)
	os.WriteFile(filepath.Join(share, "d/f"), []byte("x"), 0o644)
	os.Symlink("..", filepath.Join(share, "up"))
	fs, err := New(share, Options{Migration: MigrationOptions{OnError: MigrationGuestError}}, testLog)
	if err != nil {
		f.Fatal(err)
	}
	defer fs.Close()

	seed := func(s *migstate.State) []byte {
		var b bytes.Buffer
		if err := migstate.Encode(&b, s); err != nil {
			f.Fatal(err)
		}
		return b.Bytes()
	}
	root := migstate.Inode{ID: rootID, Refcount: 2, Loc: migstate.LocRoot, Type: unix.S_IFDIR}
	good := seed(&migstate.State{
		V2: true, Ours: true, Session: []byte("s"), NextInode: 1<<32 | 5, NextHandle: 1<<32 | 8,
		Inodes: []migstate.Inode{
			root,
			{ID: 1<<32 | 2, Refcount: 1, Loc: migstate.LocFullPath, Type: unix.S_IFDIR, Path: "d"},
			{ID: 1<<32 | 3, Refcount: 3, Loc: migstate.LocFullPath, Type: unix.S_IFREG, Path: "d/f"},
			{ID: 1<<32 | 4, Refcount: 1, Loc: migstate.LocInvalid, Type: unix.S_IFREG},
		},
		Handles: []migstate.Handle{
			{ID: 1<<32 | 5, Inode: 1<<32 | 3, Flags: unix.O_RDWR, Known: true, HostFlags: unix.O_RDWR},
			{ID: 1<<32 | 6, Inode: 1<<32 | 2, Flags: unix.O_DIRECTORY, Known: true, Dir: true},
			{ID: 1<<32 | 7, Inode: rootID, Flags: unix.O_DIRECTORY, Known: true, Dir: true},
		},
	})
	f.Add(good, false)
	f.Add(good[:len(good)/2], true)
	f.Add(seed(&migstate.State{Ours: true}), false)
	f.Add(seed(&migstate.State{V2: true, Ours: true, Inodes: []migstate.Inode{root,
		{ID: 9, Refcount: 1, Loc: migstate.LocFullPath, Type: unix.S_IFDIR, Path: "up/share"}}}), true)
	f.Add([]byte(trailerMagic), true)
	for _, s := range rustSeeds() {
		f.Add(seed(s), false)
	}
	for _, name := range []string{"rust-1.13", "govirtiofsd"} {
		if b, err := os.ReadFile(filepath.Join("testdata", name+".state")); err == nil {
			f.Add(b, false)
		}
	}
	f.Fuzz(func(t *testing.T, b []byte, fixCRC bool) {
		if fixCRC && len(b) >= 4 {
			b = slices.Clone(b)
			sum := crc32.Checksum(b[:len(b)-4], crc32.MakeTable(crc32.Castagnoli))
			b[len(b)-4], b[len(b)-3], b[len(b)-2], b[len(b)-1] = byte(sum), byte(sum>>8), byte(sum>>16), byte(sum>>24)
		}
		before := fs.Stats()
		err := fs.LoadState(bytes.NewReader(b), restoreCaps(0))
		if err != nil && fs.Stats() != before {
			t.Fatalf("failed load changed the tables: %+v → %+v", before, fs.Stats())
		}
	})
}

// Running out of fds while reopening fails the load whatever OnError says
// (the objects are fine: installing them stale would be wrong), and leaks
// nothing.
func TestMigrateEMFILE(t *testing.T) {
	runHelper(t, "migrate-emfile", nil)
}

func helperMigrateEMFILE(t *testing.T) {
	src := newTestFS(t, Options{})
	const files = 300
	src.writeFiles(files)
	for k := range files {
		src.open(src.lookup(rootID, fmt.Sprint(k)).NodeId, unix.O_RDONLY)
	}
	b := save(t, src.FS)
	dst := newDest(t, src, Options{Migration: MigrationOptions{OnError: MigrationGuestError}})
	rl := limitFDs(t, 100)
	before := openFDs(t)
	err := dst.LoadState(bytes.NewReader(b), restoreCaps(src.caps.Load()))
	if err == nil || !strings.Contains(err.Error(), "too many open files") {
		t.Fatalf("LoadState out of fds: %v", err)
	}
	if n := openFDs(t); n != before || dst.Stats() != (Stats{InodeFDs: dst.baseFDs}) {
		t.Fatalf("fds %d → %d, stats %+v", before, n, dst.Stats())
	}
	unix.Setrlimit(unix.RLIMIT_NOFILE, &rl)
	if err := dst.LoadState(bytes.NewReader(b), restoreCaps(src.caps.Load())); err != nil {
		t.Fatal(err)
	}
}
