package passthrough

import (
	"bytes"
	"fmt"
	"os"
	"slices"
	"strings"
	"syscall"
	"testing"

	gofuse "github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"github.com/govirtiofsd/govirtiofsd/internal/passthrough/migstate"
)

// States as the Rust virtiofsd writes them (no trailer: session nil),
// loaded at the FS level.

// rustStream writes s as the Rust daemon would: the message alone.
func rustStream(t *testing.T, s *migstate.State) []byte {
	t.Helper()
	c := *s
	c.Ours = false
	var b bytes.Buffer
	if err := migstate.EncodeUnchecked(&b, &c); err != nil {
		t.Fatal(err)
	}
	return b.Bytes()
}

// rustTree makes share/a/b/c/file1 ("hello"), share/x ("xx") and the
// records of a Rust state that holds them: a only on b's path (the guest
// forgot it), b, c (looked up, and parents), file1 looked up twice, x by a
// full path, a node lost on the source, ids above 2^32, and handles 0 (on
// file1), 1 (c, OPENDIR), 2 (the root, OPENDIR).
func rustTree(t *testing.T, src *testFS) *migstate.State {
	t.Helper()
	os.MkdirAll(src.path("a/b/c"), 0o755)
	os.WriteFile(src.path("a/b/c/file1"), []byte("hello"), 0o644)
	os.WriteFile(src.path("x"), []byte("xx"), 0o644)
	const (
		a     = 2
		b     = 1<<32 + 7
		c     = 8
		file1 = 9
		x     = 10
		lost  = 1<<40 + 11
	)
	return &migstate.State{V2: true, NextInode: 1<<40 + 12, NextHandle: 3,
		Opts: migstate.Negotiated{SuppGroups: true},
		Inodes: []migstate.Inode{
			// Out of order on purpose: children before parents.
			{ID: file1, Refcount: 2, Loc: migstate.LocPath, Parent: c, Path: "file1"},
			{ID: rootID, Refcount: 2 + 1, Loc: migstate.LocRoot},
			{ID: c, Refcount: 1 + 1, Loc: migstate.LocPath, Parent: b, Path: "c"},
			{ID: b, Refcount: 1 + 1, Loc: migstate.LocPath, Parent: a, Path: "b"},
			{ID: a, Refcount: 0 + 1, Loc: migstate.LocPath, Parent: rootID, Path: "a"},
			{ID: x, Refcount: 1, Loc: migstate.LocFullPath, Path: "x"},
			{ID: lost, Refcount: 1, Loc: migstate.LocInvalid},
		},
		Handles: []migstate.Handle{
			{ID: 0, Inode: file1, Flags: unix.O_RDWR},
			{ID: 1, Inode: c, Flags: unix.O_RDONLY | unix.O_DIRECTORY},
			{ID: 2, Inode: rootID, Flags: unix.O_DIRECTORY},
		},
	}
}

func TestMigrateFromRust(t *testing.T) {
	src := newTestFS(t, Options{})
	s := rustTree(t, src)
	b := rustStream(t, s)

	// --migration-on-error abort: the lost node fails the load.
	ab := newDest(t, src, Options{})
	loadFails(t, ab, b, "node 0x1000000000b (invalid on the source): unreachable on the source")

	dst := newDest(t, src, Options{Migration: MigrationOptions{OnError: MigrationGuestError}})
	var got restoreArgs
	if err := dst.LoadState(bytes.NewReader(b), recordRestore(&got, dst.Capabilities())); err != nil {
		t.Fatal(err)
	}
	if got.session != nil || !got.mounted || got.negotiated != gofuse.CAP_CREATE_SUPP_GROUP {
		t.Fatalf("restore got %+v", got)
	}
	// a is gone (only its children needed it); the others carry the
	// guest's lookups, not the child references.
	nodes, handles := dst.ids()
	want := []uint64{8, 9, 10, 1<<32 + 7, 1<<40 + 11}
	if !slices.Equal(nodes, want) || !slices.Equal(handles, []uint64{0, 1, 2}) {
		t.Fatalf("nodes %#x handles %#x", nodes, handles)
	}
	for id, n := range map[uint64]uint64{1<<32 + 7: 1, 8: 1, 9: 2, 10: 1, 1<<40 + 11: 1} {
		if got := dst.nlookup(id); got != n {
			t.Fatalf("node %#x: nlookup %d, want %d", id, got, n)
		}
	}
	// Four O_PATH fds (b, c, file1, x; a's is closed), none held by
	// file handle.
	if st := dst.Stats(); st.Inodes != 5 || st.Handles != 3 || (st.InodeFDs != dst.baseFDs+4 && !dst.useHandles) || st.HandleFDs != 3 {
		t.Fatalf("stats %+v", st)
	}
	// Served at the Rust daemon's ids, handle 0 included.
	if a := dst.getattr(9); a.Size != 5 {
		t.Fatalf("getattr %+v", a)
	}
	if got := dst.read(9, 0, 0, 64); string(got) != "hello" {
		t.Fatalf("read %q", got)
	}
	dst.write(9, 0, 5, []byte(" rust"), 0)
	if got, _ := os.ReadFile(src.path("a/b/c/file1")); string(got) != "hello rust" {
		t.Fatalf("host file %q", got)
	}
	if names, _ := dst.readdirFrom(8, 1, 0, 100); !slices.Contains(names, "file1") {
		t.Fatalf("readdir of c %q", names)
	}
	if names, _ := dst.readdirFrom(rootID, 2, 0, 100); !slices.Contains(names, "x") {
		t.Fatalf("readdir of the root %q", names)
	}
	if e := dst.lookup(1<<32+7, "c"); e.NodeId != 8 {
		t.Fatalf("lookup of c gives %#x", e.NodeId)
	}
	var ao gofuse.AttrOut
	if errno := dst.GetAttr(&gofuse.GetAttrIn{InHeader: *hdr(1<<40 + 11)}, &ao); errno != syscall.ESTALE {
		t.Fatalf("lost node: %v", errno)
	}
	// New ids are new; FORGET and RELEASE free everything.
	checkNewIDs(t, dst, 100, nodes, handles)
	dst.release(9, 0)
	dst.ReleaseDir(&gofuse.ReleaseIn{InHeader: *hdr(8), Fh: 1})
	dst.ReleaseDir(&gofuse.ReleaseIn{InHeader: *hdr(rootID), Fh: 2})
	dst.Forget(8, 2) // the lookup above
	for _, id := range []uint64{9, 9, 10, 1<<32 + 7, 1<<40 + 11} {
		dst.Forget(id, 1)
	}
	if st := dst.Stats(); st != (Stats{InodeFDs: dst.baseFDs}) {
		t.Fatalf("after release and forget: %+v", st)
	}
}

// The Rust daemon's refusals, and ours of what it would choke on.
func TestMigrateFromRustRefused(t *testing.T) {
	src := newTestFS(t, Options{})
	good := rustTree(t, src)
	edits := []struct {
		name string
		edit func(s *migstate.State)
		want string
	}{
		{"parent missing", func(s *migstate.State) { s.Inodes = slices.Delete(s.Inodes, 4, 5) }, "its parent 0x2 is missing"},
		{"handle without its inode", func(s *migstate.State) { s.Handles[0].Inode = 77 }, "handle 0x0: its inode 0x4d is missing"},
		{"handle on a path-only inode", func(s *migstate.State) { s.Handles[0].Inode = 2 }, "has no lookup"},
		{"no root", func(s *migstate.State) { s.Inodes = slices.Delete(s.Inodes, 1, 2) }, "without the root"},
		{"root count gone", func(s *migstate.State) { s.Inodes[1].Refcount = 1 }, "refcount 1 below its 2 child references"},
		{"cycle", func(s *migstate.State) {
			s.Inodes[4].Parent = 8 // a below c, c below b, b below a
			s.Inodes[2].Refcount++
		}, "a cycle of parents"},
		{"posix acl off here", func(s *migstate.State) { s.Opts.PosixACL = true }, "POSIX ACLs"},
	}
	for _, policy := range []MigrationOnError{MigrationAbort, MigrationGuestError} {
		dst := newDest(t, src, Options{Migration: MigrationOptions{OnError: policy}})
		for _, tc := range edits {
			t.Run(fmt.Sprint(tc.name, "/", policy), func(t *testing.T) {
				s := rustTree(t, src)
				*s = *good
				s.Inodes = slices.Clone(good.Inodes)
				s.Handles = slices.Clone(good.Handles)
				tc.edit(s)
				loadFails(t, dst, rustStream(t, s), tc.want)
			})
		}
	}
}

// ours → Rust → ours: the Rust daemon issued ids after ours' next_inode
// and next_handle, so ids of both may share a slot index (3 and 1<<32|3),
// and its handle ids start at 0. All are served at their ids, through the
// overflow map where needed, and no new id equals one in use.
func TestMigrateIDCollision(t *testing.T) {
	src := newTestFS(t, Options{})
	for _, n := range []string{"f3", "g3", "h"} {
		os.WriteFile(src.path(n), []byte(n), 0o644)
	}
	s := &migstate.State{V2: true, NextInode: 1<<32 + 4, NextHandle: 1<<32 + 4,
		Inodes: []migstate.Inode{
			{ID: rootID, Refcount: 2, Loc: migstate.LocRoot},
			{ID: 3, Refcount: 1, Loc: migstate.LocFullPath, Path: "f3"},
			{ID: 1<<32 | 3, Refcount: 1, Loc: migstate.LocFullPath, Path: "g3"},
			{ID: maxSlots + 5, Refcount: 1, Loc: migstate.LocFullPath, Path: "h"},
		},
		Handles: []migstate.Handle{
			{ID: 0, Inode: 3, Flags: unix.O_RDONLY},
			{ID: 3, Inode: 1<<32 | 3, Flags: unix.O_RDONLY},
			{ID: 1<<32 | 3, Inode: maxSlots + 5, Flags: unix.O_RDONLY},
		},
	}
	// A --security-label destination loads it too (it was refused while
	// this daemon could not set the contexts a Rust session's guest sends).
	sl := newDest(t, src, Options{Xattr: true, SecurityLabel: true})
	if err := sl.LoadState(bytes.NewReader(rustStream(t, s)), restoreCaps(sl.Capabilities())); err != nil {
		t.Fatalf("--security-label destination: %v", err)
	}
	dst := newDest(t, src, Options{})
	if err := dst.LoadState(bytes.NewReader(rustStream(t, s)), restoreCaps(dst.Capabilities())); err != nil {
		t.Fatal(err)
	}
	if dst.nodes.nover.Load() != 2 || dst.handles.nover.Load() != 2 {
		t.Fatalf("overflow: %d nodes, %d handles", dst.nodes.nover.Load(), dst.handles.nover.Load())
	}
	check := func(f *testFS) {
		t.Helper()
		for _, c := range []struct {
			node, fh uint64
			want     string
		}{{3, 0, "f3"}, {1<<32 | 3, 3, "g3"}, {maxSlots + 5, 1<<32 | 3, "h"}} {
			if got := f.read(c.node, c.fh, 0, 8); string(got) != c.want {
				t.Fatalf("node %#x handle %#x reads %q", c.node, c.fh, got)
			}
		}
	}
	check(dst)
	nodesInUse := map[uint64]bool{3: true, 1<<32 | 3: true, maxSlots + 5: true}
	handlesInUse := map[uint64]bool{0: true, 3: true, 1<<32 | 3: true}
	for k := range 3 * 64 * 5 {
		os.WriteFile(dst.path(fmt.Sprint("n", k)), nil, 0o644)
		e := dst.lookup(rootID, fmt.Sprint("n", k))
		h := dst.open(e.NodeId, unix.O_RDONLY)
		if nodesInUse[e.NodeId] || handlesInUse[h] {
			t.Fatalf("new id in use: node %#x handle %#x", e.NodeId, h)
		}
		nodesInUse[e.NodeId], handlesInUse[h] = true, true
	}
	// And back: ours saves next ids above all of them, and a third
	// daemon serves the same ids.
	b := save(t, dst.FS)
	s2 := decoded(t, b)
	var maxNode, maxHandle uint64
	for _, r := range s2.Inodes {
		maxNode = max(maxNode, r.ID)
	}
	for _, h := range s2.Handles {
		maxHandle = max(maxHandle, h.ID)
	}
	if s2.NextInode <= maxNode || s2.NextHandle <= maxHandle {
		t.Fatalf("next ids %#x %#x, in use up to %#x %#x", s2.NextInode, s2.NextHandle, maxNode, maxHandle)
	}
	third := newDest(t, src, Options{})
	if err := third.LoadState(bytes.NewReader(b), restoreCaps(dst.caps.Load())); err != nil {
		t.Fatal(err)
	}
	check(third)
	n1, h1 := dst.ids()
	n2, h2 := third.ids()
	if !slices.Equal(n1, n2) || !slices.Equal(h1, h2) {
		t.Fatal("ids differ after ours → ours")
	}
	// And ours → the Rust format (the message alone) → ours.
	fourth := newDest(t, src, Options{})
	if err := fourth.LoadState(bytes.NewReader(messageOnly(t, s2)), restoreCaps(dst.caps.Load())); err != nil {
		t.Fatal(err)
	}
	check(fourth)
	if n4, h4 := fourth.ids(); !slices.Equal(n1, n4) || !slices.Equal(h1, h4) {
		t.Fatal("ids differ after ours → Rust format → ours")
	}
	// FORGET and RELEASE of overflow ids and of slot ids: the freed
	// slots 3 come back under generations the overflow maps do not hold.
	third.release(3, 0)
	third.release(1<<32|3, 3)
	third.Forget(3, 1)
	if third.handles.get(0) != nil || third.handles.get(3) != nil || third.nodes.get(3) != nil {
		t.Fatal("ids still there")
	}
	reused := 0
	for k := range 3 * 64 * 5 {
		os.WriteFile(third.path(fmt.Sprint("m", k)), nil, 0o644)
		e := third.lookup(rootID, fmt.Sprint("m", k))
		h := third.open(e.NodeId, unix.O_RDONLY)
		if e.NodeId == 1<<32|3 || e.NodeId == maxSlots+5 || h == 1<<32|3 {
			t.Fatalf("new id in use: node %#x handle %#x", e.NodeId, h)
		}
		if uint32(e.NodeId) == 3 {
			reused++
		}
		if uint32(h) == 3 {
			reused++
		}
	}
	if reused != 2 {
		t.Fatalf("slot 3 reused %d times, want once per table", reused)
	}
	if third.nodes.get(1<<32|3) == nil || third.handles.get(1<<32|3) == nil {
		t.Fatal("overflow ids lost")
	}
}

// Ours as the Rust daemon sees it: the message alone (the trailer cut off)
// loads too, handle kinds from O_DIRECTORY, the session rebuilt by the
// caller; a non-UTF-8 path is Invalid there and travels in our trailer.
func TestMigrateOursAsRust(t *testing.T) {
	src := newTestFS(t, Options{})
	os.Mkdir(src.path("d"), 0o755)
	os.WriteFile(src.path("d/f"), []byte("data"), 0o644)
	os.WriteFile(src.path("bad\xff"), []byte("odd"), 0o644)
	d := src.lookup(rootID, "d").NodeId
	f := src.lookup(d, "f").NodeId
	odd := src.lookup(rootID, "bad\xff").NodeId
	fh := src.open(f, unix.O_WRONLY|unix.O_APPEND)
	dfh := src.opendir(d)
	b := save(t, src.FS)
	s := decoded(t, b)
	if r := record(s, odd); r.Loc != migstate.LocInvalid || r.RawPath != "bad\xff" {
		t.Fatalf("odd record %+v", r)
	}
	for _, h := range s.Handles {
		switch h.ID {
		case fh:
			if h.Flags != unix.O_WRONLY || h.HostFlags != unix.O_WRONLY|unix.O_APPEND || h.Dir {
				t.Fatalf("file handle %+v", h)
			}
		case dfh:
			if h.Flags != unix.O_DIRECTORY || !h.Dir {
				t.Fatalf("dir handle %+v", h)
			}
		}
	}
	// Ours → ours: the odd name too.
	dst := newDest(t, src, Options{})
	if err := dst.LoadState(bytes.NewReader(b), restoreCaps(src.caps.Load())); err != nil {
		t.Fatal(err)
	}
	if a := dst.getattr(odd); a.Size != 3 {
		t.Fatalf("odd node %+v", a)
	}
	// The message alone: what a Rust destination reads.
	rust := newDest(t, src, Options{Migration: MigrationOptions{OnError: MigrationGuestError}})
	var got restoreArgs
	if err := rust.LoadState(bytes.NewReader(messageOnly(t, s)), recordRestore(&got, src.caps.Load())); err != nil {
		t.Fatal(err)
	}
	if got.session != nil || !got.mounted {
		t.Fatalf("restore got %+v", got)
	}
	if names, _ := rust.readdirFrom(d, dfh, 0, 100); !slices.Contains(names, "f") {
		t.Fatalf("readdir %q", names)
	}
	// The guest writes an O_APPEND file at its end.
	rust.write(f, fh, 4, []byte("!"), 0)
	if b, _ := os.ReadFile(src.path("d/f")); string(b) != "data!" {
		t.Fatalf("host file %q", b)
	}
	var ao gofuse.AttrOut
	if errno := rust.GetAttr(&gofuse.GetAttrIn{InHeader: *hdr(odd)}, &ao); errno != syscall.ESTALE {
		t.Fatalf("odd node without the trailer: %v", errno)
	}
}

// --migration-mode file-handles: an open file unlinked on the host
// migrates, and the handle inodes are found through the mount path.
func TestMigrateFileHandles(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("open_by_handle_at needs CAP_DAC_READ_SEARCH")
	}
	fhOpts := Options{Migration: MigrationOptions{Mode: MigrationFileHandles}}
	src := newTestFS(t, fhOpts)
	os.Mkdir(src.path("d"), 0o755)
	os.WriteFile(src.path("d/gone"), []byte("unlinked but open"), 0o644)
	os.WriteFile(src.path("keep"), []byte("kept"), 0o644)
	d := src.lookup(rootID, "d").NodeId
	gone := src.lookup(d, "gone").NodeId
	keep := src.lookup(rootID, "keep").NodeId
	fh := src.open(gone, unix.O_RDWR)
	if err := os.Remove(src.path("d/gone")); err != nil {
		t.Fatal(err)
	}
	src.PrepareMigration()
	b := save(t, src.FS)
	src.CancelMigration()
	s := decoded(t, b)
	for _, r := range s.Inodes {
		if r.ID != rootID && r.Loc != migstate.LocFileHandle {
			t.Fatalf("record %+v", r)
		}
	}
	if len(s.MountPaths) != 1 || s.MountPaths[0].Path != "." || s.MountPaths[0].MountID != src.root.key.mntID {
		t.Fatalf("mount paths %+v", s.MountPaths)
	}
	for _, dopts := range []Options{{}, {InodeFileHandles: FileHandlesPrefer}} {
		dst := newDest(t, src, dopts)
		if err := dst.LoadState(bytes.NewReader(b), restoreCaps(src.caps.Load())); err != nil {
			t.Fatal(err)
		}
		if got := dst.read(gone, fh, 0, 64); string(got) != "unlinked but open" {
			t.Fatalf("unlinked file reads %q", got)
		}
		if a := dst.getattr(keep); a.Size != 4 {
			t.Fatalf("keep %+v", a)
		}
	}
	// Without a mount path, the handles cannot be opened: per OnError.
	s.MountPaths = nil
	dst := newDest(t, src, Options{})
	loadFails(t, dst, reencode(t, s), "the source gave no path for its mount")
	ge := newDest(t, src, Options{Migration: MigrationOptions{OnError: MigrationGuestError}})
	if err := ge.LoadState(bytes.NewReader(reencode(t, s)), restoreCaps(src.caps.Load())); err != nil {
		t.Fatal(err)
	}
	var ao gofuse.AttrOut
	if errno := ge.GetAttr(&gofuse.GetAttrIn{InHeader: *hdr(keep)}, &ao); errno != syscall.ESTALE {
		t.Fatalf("without its mount: %v", errno)
	}
	// A handle the file system does not know.
	s.MountPaths = []migstate.MountPath{{MountID: src.root.key.mntID, Path: "."}}
	r := record(s, keep)
	r.Handle.Bytes = bytes.Repeat([]byte{0xee}, len(r.Handle.Bytes))
	loadFails(t, newDest(t, src, Options{}), reencode(t, s), "open_by_handle_at")
}

// --migration-verify-handles: a file replaced on the host after the
// source saved is another object on the destination: refused (abort) or
// stale; the records are Path{parent 1} so that the Rust 1.13 loader
// checks them too. Another shared directory is refused outright.
func TestMigrateVerifyHandles(t *testing.T) {
	if _, err := nameToHandle(-100); err == syscall.EOPNOTSUPP {
		t.Skip("no file handles here")
	}
	src := newTestFS(t, Options{Migration: MigrationOptions{VerifyHandles: true}})
	os.WriteFile(src.path("f"), []byte("first"), 0o644)
	os.WriteFile(src.path("g"), []byte("g"), 0o644)
	f := src.lookup(rootID, "f").NodeId
	g := src.lookup(rootID, "g").NodeId
	src.PrepareMigration()
	b := save(t, src.FS)
	src.CancelMigration()
	s := decoded(t, b)
	root := record(s, rootID)
	if root.Verify == nil || root.Refcount != rootRefcount+2 {
		t.Fatalf("root %+v", root)
	}
	for _, id := range []uint64{f, g} {
		if r := record(s, id); r.Loc != migstate.LocPath || r.Parent != rootID || r.Verify == nil {
			t.Fatalf("record %+v", r)
		}
	}
	// Unchanged: loads.
	if err := newDest(t, src, Options{}).LoadState(bytes.NewReader(b), restoreCaps(src.caps.Load())); err != nil {
		t.Fatal(err)
	}
	// f replaced by another file of the same name.
	os.Rename(src.path("f"), src.path("f.old"))
	os.WriteFile(src.path("f"), []byte("second"), 0o644)
	loadFails(t, newDest(t, src, Options{}), b, "not the object the source had")
	ge := newDest(t, src, Options{Migration: MigrationOptions{OnError: MigrationGuestError}})
	if err := ge.LoadState(bytes.NewReader(b), restoreCaps(src.caps.Load())); err != nil {
		t.Fatal(err)
	}
	var ao gofuse.AttrOut
	if errno := ge.GetAttr(&gofuse.GetAttrIn{InHeader: *hdr(f)}, &ao); errno != syscall.ESTALE {
		t.Fatalf("replaced file: %v", errno)
	}
	if a := ge.getattr(g); a.Size != 1 {
		t.Fatalf("g %+v", a)
	}
	// Another share with the same names.
	other := newTestFS(t, Options{})
	os.WriteFile(other.path("f"), nil, 0o644)
	os.WriteFile(other.path("g"), nil, 0o644)
	odst := newDest(t, other, Options{Migration: MigrationOptions{OnError: MigrationGuestError}})
	loadFails(t, odst, b, "the shared directory is not the source's")

	// File handles mode refuses the find-paths checks, as the Rust
	// daemon does.
	if _, err := New(src.dir, Options{Migration: MigrationOptions{Mode: MigrationFileHandles, VerifyHandles: true}}, testLog); err == nil ||
		!strings.Contains(err.Error(), "find-paths mode only") {
		t.Fatalf("New: %v", err)
	}
}
