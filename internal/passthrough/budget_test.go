package passthrough

import (
	"bytes"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"

	gofuse "github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"
)

// budgetFS is a file system held by fds with the smallest budget, so that
// nearly every request evicts or reopens.
func budgetFS(t *testing.T) *testFS {
	t.Helper()
	return budgetFSWith(t, Options{InodeFDBudget: fdBudgetMin})
}

func budgetFSWith(t *testing.T, opts Options) *testFS {
	t.Helper()
	tf := newTestFS(t, opts)
	tf.nameInline = true // eviction starts when the budget is reached
	if tf.useHandles {
		t.Skip("inodes held by file handle: no fd budget")
	}
	return tf
}

// evictUnused evicts every inode the policy allows that nothing uses, as
// two turns of the clock do.
func (f *FS) evictUnused() {
	f.startTracking()
	f.naming.Wait()
	f.evictMu.Lock()
	defer f.evictMu.Unlock()
	for range 2 {
		for idx := range f.nodes.span() {
			if i := f.nodes.at(idx); i != nil {
				f.tryEvict(i)
			}
		}
	}
}

func (tf *testFS) resident(node uint64) bool {
	return tf.nodes.get(node).residentFD() >= 0
}

func (tf *testFS) getattrErr(node uint64) (gofuse.AttrOut, syscall.Errno) {
	var out gofuse.AttrOut
	errno := tf.GetAttr(&gofuse.GetAttrIn{InHeader: *hdr(node)}, &out)
	return out, errno
}

// mkTree makes dirs directories of files files each on the host: dN/fM.
func mkTree(t *testing.T, tf *testFS, dirs, files int) {
	t.Helper()
	for d := range dirs {
		if err := os.Mkdir(tf.path(fmt.Sprintf("d%d", d)), 0o755); err != nil {
			t.Fatal(err)
		}
		for n := range files {
			if err := os.WriteFile(tf.path(fmt.Sprintf("d%d/f%d", d, n)), []byte(fmt.Sprint(d, n)), 0o644); err != nil {
				t.Fatal(err)
			}
		}
	}
}

// TestBudgetBounded looks up 200 files with a budget of 16: the resident
// fds stay near the budget, and every inode still answers with its own
// attributes (reopened through its parent's name).
func TestBudgetBounded(t *testing.T) {
	tf := budgetFS(t)
	mkTree(t, tf, 10, 20)
	type held struct {
		node uint64
		ino  uint64
		path string
	}
	var all []held
	for d := range 10 {
		dn := tf.lookup(rootID, fmt.Sprintf("d%d", d)).NodeId
		for n := range 20 {
			p := fmt.Sprintf("d%d/f%d", d, n)
			e := tf.lookup(dn, fmt.Sprintf("f%d", n))
			all = append(all, held{e.NodeId, statHost(t, tf.path(p)).Ino, p})
		}
	}
	if r := tf.residentFDs.Load(); r > fdBudgetMin {
		t.Fatalf("%d resident fds, budget %d", r, fdBudgetMin)
	}
	if tf.evictedNow.Load() == 0 {
		t.Fatal("nothing evicted")
	}
	for _, h := range all {
		if a := tf.getattr(h.node); a.Ino != h.ino {
			t.Fatalf("%s: ino %d, want %d", h.path, a.Ino, h.ino)
		}
		fh := tf.open(h.node, unix.O_RDONLY)
		got := tf.read(h.node, fh, 0, 100)
		tf.release(h.node, fh)
		var d, n int
		fmt.Sscanf(h.path, "d%d/f%d", &d, &n)
		if string(got) != fmt.Sprint(d, n) {
			t.Fatalf("%s reads %q", h.path, got)
		}
	}
	if tf.reopens.Load() == 0 || tf.estales.Load() != 0 {
		t.Fatalf("reopens %d, estales %d", tf.reopens.Load(), tf.estales.Load())
	}
	if r := tf.residentFDs.Load(); r > fdBudgetMin+1 {
		t.Fatalf("%d resident fds after the reads, budget %d", r, fdBudgetMin)
	}
	// Forgetting everything leaves no fd but the root's.
	for _, h := range all {
		tf.Forget(h.node, 1)
	}
	for d := range 10 {
		tf.Forget(tf.lookup(rootID, fmt.Sprintf("d%d", d)).NodeId, 2)
	}
	if s := tf.Stats(); s.Inodes != 0 || s.InodeFDs != tf.baseFDs || tf.residentFDs.Load() != 0 || tf.evictedNow.Load() != 0 {
		t.Fatalf("after forget: %+v, resident %d, evicted %d", s, tf.residentFDs.Load(), tf.evictedNow.Load())
	}
}

// TestBudgetBelowIsUnchanged: below the budget nothing is evicted or
// reopened.
func TestBudgetBelowIsUnchanged(t *testing.T) {
	tf := newTestFS(t, Options{InodeFDBudget: 1000, InodeFileHandles: FileHandlesNever})
	if tf.useHandles {
		t.Skip("inodes held by file handle: no fd budget")
	}
	mkTree(t, tf, 5, 20)
	for d := range 5 {
		dn := tf.lookup(rootID, fmt.Sprintf("d%d", d)).NodeId
		for n := range 20 {
			tf.getattr(tf.lookup(dn, fmt.Sprintf("f%d", n)).NodeId)
		}
	}
	if tf.evictedNow.Load() != 0 || tf.reopens.Load() != 0 || tf.residentFDs.Load() != 105 {
		t.Fatalf("evicted %d, reopens %d, resident %d", tf.evictedNow.Load(), tf.reopens.Load(), tf.residentFDs.Load())
	}
}

// TestBudgetDeep reopens an inode 40 directories down whose ancestors are
// all evicted.
func TestBudgetDeep(t *testing.T) {
	tf := budgetFS(t)
	p := tf.dir
	node := uint64(rootID)
	for d := range 40 {
		p = filepath.Join(p, fmt.Sprint("l", d))
		if err := os.Mkdir(p, 0o755); err != nil {
			t.Fatal(err)
		}
		node = tf.lookup(node, fmt.Sprint("l", d)).NodeId
	}
	os.WriteFile(filepath.Join(p, "leaf"), []byte("deep"), 0o644)
	leaf := tf.lookup(node, "leaf").NodeId
	tf.evictUnused()
	if tf.resident(leaf) || tf.resident(node) {
		t.Fatal("not evicted")
	}
	if a := tf.getattr(leaf); a.Ino != statHost(t, filepath.Join(p, "leaf")).Ino {
		t.Fatalf("ino %d", a.Ino)
	}
}

// TestBudgetGuestRename: the guest's RENAME (plain and exchange) of
// evicted inodes, and of an evicted inode's parent directory, keeps them
// reachable.
func TestBudgetGuestRename(t *testing.T) {
	tf := budgetFS(t)
	mkTree(t, tf, 2, 2)
	d0 := tf.lookup(rootID, "d0").NodeId
	d1 := tf.lookup(rootID, "d1").NodeId
	f0 := tf.lookup(d0, "f0").NodeId
	f1 := tf.lookup(d0, "f1").NodeId
	g0 := tf.lookup(d1, "f0").NodeId
	ino := func(p string) uint64 { return statHost(t, tf.path(p)).Ino }
	want := map[uint64]uint64{f0: ino("d0/f0"), f1: ino("d0/f1"), g0: ino("d1/f0"), d0: ino("d0")}
	check := func(step string) {
		t.Helper()
		tf.evictUnused()
		for node, w := range want {
			if a, errno := tf.getattrErr(node); errno != 0 || a.Ino != w {
				t.Fatalf("%s: node %#x: ino %d, %v; want %d", step, node, a.Ino, errno, w)
			}
		}
	}
	check("start")
	rename := func(od uint64, on string, nd uint64, nn string, flags uint32) {
		t.Helper()
		tf.evictUnused()
		if errno := tf.Rename(hdr(od), nd, flags, []byte(on), []byte(nn)); errno != 0 {
			t.Fatalf("rename %s → %s: %v", on, nn, errno)
		}
	}
	rename(d0, "f0", d1, "moved", 0)
	check("rename across directories")
	rename(d1, "moved", d0, "f1", unix.RENAME_EXCHANGE)
	check("exchange")
	rename(rootID, "d0", rootID, "e0", 0)
	check("rename of the parent")
	// Rename over an evicted inode: the replaced one keeps its fd.
	rename(d1, "f0", d1, "moved", 0) // d1/moved is f1's... whichever: replaced
	if errno := tf.Rename(hdr(d1), d1, 0, []byte("moved"), []byte("f0")); errno != 0 {
		t.Fatal(errno)
	}
	if tf.estales.Load() != 0 {
		t.Fatalf("%d ESTALE", tf.estales.Load())
	}
	if e := tf.lookup(d1, "f0"); e.NodeId != g0 {
		t.Fatalf("lookup after the renames gives %#x, want %#x", e.NodeId, g0)
	}
}

// TestBudgetGuestReplace: an evicted inode the guest renames another file
// over, or unlinks, keeps working while the guest holds it (its fd made
// resident for good), and a hard link's new name is followed.
func TestBudgetGuestReplace(t *testing.T) {
	tf := budgetFS(t)
	os.WriteFile(tf.path("victim"), []byte("v"), 0o644)
	os.WriteFile(tf.path("other"), []byte("o"), 0o644)
	os.WriteFile(tf.path("gone"), []byte("g"), 0o644)
	os.WriteFile(tf.path("linked"), []byte("l"), 0o644)
	victim := tf.lookup(rootID, "victim").NodeId
	gone := tf.lookup(rootID, "gone").NodeId
	linked := tf.lookup(rootID, "linked").NodeId
	vIno, gIno, lIno := statHost(t, tf.path("victim")).Ino, statHost(t, tf.path("gone")).Ino, statHost(t, tf.path("linked")).Ino
	tf.lookup(rootID, "other")
	tf.evictUnused()
	if errno := tf.Rename(hdr(rootID), rootID, 0, []byte("other"), []byte("victim")); errno != 0 {
		t.Fatal(errno)
	}
	// Guest LINK, then UNLINK of the recorded name: the new one is used.
	var lo gofuse.EntryOut
	if errno := tf.Link(&gofuse.LinkIn{InHeader: *hdr(rootID), Oldnodeid: linked}, []byte("linked2"), &lo); errno != 0 || lo.NodeId != linked {
		t.Fatalf("link: %v, node %#x", errno, lo.NodeId)
	}
	tf.evictUnused()
	for _, n := range []string{"gone", "linked"} {
		if errno := tf.Unlink(hdr(rootID), []byte(n)); errno != 0 {
			t.Fatal(errno)
		}
	}
	for range 3 {
		tf.evictUnused()
		if !tf.resident(victim) || !tf.resident(gone) {
			t.Fatal("a nameless inode was evicted")
		}
		if tf.resident(linked) {
			t.Fatal("the linked inode has a name and should have been evicted")
		}
		for node, ino := range map[uint64]uint64{victim: vIno, gone: gIno, linked: lIno} {
			if a, errno := tf.getattrErr(node); errno != 0 || a.Ino != ino {
				t.Fatalf("node %#x: ino %d, %v; want %d", node, a.Ino, errno, ino)
			}
		}
	}
}

// TestBudgetHostChanges: a host-side rename, replace or unlink of an
// evicted inode, or a swap of its parent for a symlink leading out of the
// share, answers ESTALE: never another file, never one outside.
func TestBudgetHostChanges(t *testing.T) {
	for _, tc := range []struct {
		name   string
		change func(tf *testFS)
	}{
		{"rename", func(tf *testFS) { must(tf.t, os.Rename(tf.path("d/f"), tf.path("d/g"))) }},
		{"replace", func(tf *testFS) {
			must(tf.t, os.WriteFile(tf.path("d/new"), []byte("impostor"), 0o644))
			must(tf.t, os.Rename(tf.path("d/new"), tf.path("d/f")))
		}},
		{"unlink", func(tf *testFS) { must(tf.t, os.Remove(tf.path("d/f"))) }},
		{"parent moved out, symlink in its place", func(tf *testFS) {
			out := filepath.Join(tf.base, "outside")
			must(tf.t, os.Rename(tf.path("d"), out))
			must(tf.t, os.Symlink(out, tf.path("d")))
		}},
		{"parent replaced by a symlink to a look-alike outside", func(tf *testFS) {
			out := filepath.Join(tf.base, "lookalike")
			must(tf.t, os.Mkdir(out, 0o755))
			must(tf.t, os.WriteFile(filepath.Join(out, "f"), []byte("outside"), 0o644))
			must(tf.t, os.Rename(tf.path("d"), tf.path("d.old")))
			must(tf.t, os.Symlink(out, tf.path("d")))
		}},
		{"parent replaced by a directory", func(tf *testFS) {
			must(tf.t, os.Rename(tf.path("d"), tf.path("d.old")))
			must(tf.t, os.Mkdir(tf.path("d"), 0o755))
			must(tf.t, os.WriteFile(tf.path("d/f"), []byte("impostor"), 0o644))
		}},
	} {
		for _, fid := range []bool{true, false} {
			t.Run(fmt.Sprintf("%s/fid=%v", tc.name, fid), func(t *testing.T) {
				tf := budgetFS(t)
				if !fid {
					// As on a file system without AT_HANDLE_FID:
					// identity by device and inode number.
					tf.noFID = map[uint64]bool{tf.root.key.mntID: true}
				}
				hostChange(t, tf, tc.change)
			})
		}
	}
}

// hostChange evicts d and d/f, lets change act on the host, and expects
// ESTALE from d/f.
func hostChange(t *testing.T, tf *testFS, change func(tf *testFS)) {
	t.Helper()
	must(t, os.Mkdir(tf.path("d"), 0o755))
	must(t, os.WriteFile(tf.path("d/f"), []byte("mine"), 0o644))
	d := tf.lookup(rootID, "d").NodeId
	f := tf.lookup(d, "f").NodeId
	tf.evictUnused()
	if got := tf.nodes.get(f).fid.Load() != nil; got != (tf.noFID == nil) {
		t.Fatalf("FID recorded: %v", got)
	}
	if tf.resident(f) || tf.resident(d) {
		t.Fatal("not evicted")
	}
	change(tf)
	if a, errno := tf.getattrErr(f); errno != syscall.ESTALE {
		t.Fatalf("getattr: %v (ino %d), want ESTALE", errno, a.Ino)
	}
	var out gofuse.OpenOut
	if errno := tf.Open(&gofuse.OpenIn{InHeader: *hdr(f), Flags: unix.O_RDONLY}, &out); errno != syscall.ESTALE {
		t.Fatalf("open: %v, want ESTALE", errno)
	}
	if tf.estales.Load() == 0 {
		t.Fatal("ESTALE not counted")
	}
}

func TestDefaultFDBudget(t *testing.T) {
	for _, c := range [][2]uint64{{20000, 10000}, {1 << 20, 1 << 19}, {1, fdBudgetMin}, {^uint64(0), 1 << 30}} {
		if got := defaultFDBudget(c[0]); uint64(got) != c[1] {
			t.Errorf("RLIMIT_NOFILE %d: budget %d, want %d", c[0], got, c[1])
		}
	}
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// TestBudgetConcurrent runs lookups, getattrs, reads, renames and forgets
// from many goroutines with a budget of 16, eviction running all along
// (with -race: the fd word and the names). The guest's renames are
// tracked, so no request may fail and every getattr must give the node's
// own object.
func TestBudgetConcurrent(t *testing.T) {
	tf := budgetFS(t)
	const dirs, files = 8, 16
	mkTree(t, tf, dirs, files)
	dn := make([]uint64, dirs)
	for d := range dirs {
		dn[d] = tf.lookup(rootID, fmt.Sprintf("d%d", d)).NodeId
	}
	var wg sync.WaitGroup
	errs := make(chan error, 16)
	for g := 0; g < 8; g += 4 {
		must(t, os.WriteFile(tf.path(fmt.Sprintf("d%d/g%d", g%dirs, g)), nil, 0o644))
	}
	// A directory renamed back and forth under the others' requests.
	wg.Add(1)
	go func() {
		defer wg.Done()
		for it := range 200 {
			from, to := "d0", "d0-renamed"
			if it%2 == 1 {
				from, to = to, from
			}
			if errno := tf.Rename(hdr(rootID), rootID, 0, []byte(from), []byte(to)); errno != 0 {
				errs <- fmt.Errorf("rename %s: %v", from, errno)
				return
			}
		}
	}()
	for g := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			type kept struct{ node, ino uint64 }
			var held []kept
			for it := range 300 {
				if len(held) > 0 {
					// A node held for a while, most likely evicted.
					k := held[(it*13)%len(held)]
					if a, errno := tf.getattrErr(k.node); errno != 0 || a.Ino != k.ino {
						errs <- fmt.Errorf("getattr held %#x: ino %d, %v; want %d", k.node, a.Ino, errno, k.ino)
						return
					}
				}
				d := (g + it) % dirs
				name := fmt.Sprintf("f%d", (it*7+g)%files)
				if g%4 == 0 && it%3 == 0 {
					// Rename a file of our own back and forth.
					own := fmt.Sprintf("g%d", g)
					var e gofuse.EntryOut
					if errno := tf.Lookup(hdr(dn[g%dirs]), []byte(own), &e); errno != 0 {
						errs <- fmt.Errorf("lookup own %s: %v", own, errno)
						return
					}
					to := dn[(g+it)%dirs]
					if errno := tf.Rename(hdr(dn[g%dirs]), to, 0, []byte(own), []byte(own)); errno != 0 {
						errs <- fmt.Errorf("rename: %v", errno)
						return
					}
					if _, errno := tf.getattrErr(e.NodeId); errno != 0 {
						errs <- fmt.Errorf("getattr renamed: %v", errno)
						return
					}
					if errno := tf.Rename(hdr(to), dn[g%dirs], 0, []byte(own), []byte(own)); errno != 0 {
						errs <- fmt.Errorf("rename back: %v", errno)
						return
					}
					tf.Forget(e.NodeId, 1)
					continue
				}
				var e gofuse.EntryOut
				if errno := tf.Lookup(hdr(dn[d]), []byte(name), &e); errno != 0 {
					errs <- fmt.Errorf("lookup: %v", errno)
					return
				}
				a, errno := tf.getattrErr(e.NodeId)
				if errno != 0 || a.Ino != e.Attr.Ino {
					errs <- fmt.Errorf("getattr d%d/%s: ino %d, %v; want %d", d, name, a.Ino, errno, e.Attr.Ino)
					return
				}
				if it%5 == 0 {
					var o gofuse.OpenOut
					if errno := tf.Open(&gofuse.OpenIn{InHeader: *hdr(e.NodeId), Flags: unix.O_RDONLY}, &o); errno != 0 {
						errs <- fmt.Errorf("open: %v", errno)
						return
					}
					buf := make([]byte, 16)
					n, errno := tf.Read(&gofuse.ReadIn{InHeader: *hdr(e.NodeId), Fh: o.Fh, Size: 16}, vecOver(buf))
					tf.release(e.NodeId, o.Fh)
					var fn int
					fmt.Sscanf(name, "f%d", &fn)
					if errno != 0 || !bytes.Equal(buf[:n], []byte(fmt.Sprint(d, fn))) {
						errs <- fmt.Errorf("read d%d/%s: %q, %v", d, name, buf[:n], errno)
						return
					}
				}
				if it%2 == 0 {
					tf.Forget(e.NodeId, 1)
				} else {
					held = append(held, kept{e.NodeId, e.Attr.Ino})
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if tf.estales.Load() != 0 {
		t.Errorf("%d ESTALE", tf.estales.Load())
	}
	if tf.evictedNow.Load() == 0 && tf.reopens.Load() == 0 {
		t.Error("no eviction happened")
	}
	t.Logf("reopens %d, evicted now %d, resident %d", tf.reopens.Load(), tf.evictedNow.Load(), tf.residentFDs.Load())
}

// TestBudgetMigrate migrates a guest whose inodes are mostly evicted, in
// both modes, to a destination with the same budget, where the restored
// inodes are named and can be evicted and reopened in turn.
func TestBudgetMigrate(t *testing.T) {
	for _, mode := range []MigrationMode{MigrationFindPaths, MigrationFileHandles} {
		t.Run(mode.String(), func(t *testing.T) {
			opts := Options{InodeFDBudget: fdBudgetMin, Migration: MigrationOptions{Mode: mode}}
			src := budgetFSWith(t, opts)
			mkTree(t, src, 6, 10)
			want := map[uint64]uint64{} // node → host inode number
			for d := range 6 {
				dn := src.lookup(rootID, fmt.Sprintf("d%d", d))
				want[dn.NodeId] = dn.Attr.Ino
				for n := range 10 {
					e := src.lookup(dn.NodeId, fmt.Sprintf("f%d", n))
					want[e.NodeId] = e.Attr.Ino
				}
			}
			src.evictUnused()
			if src.evictedNow.Load() < 50 {
				t.Fatalf("%d evicted", src.evictedNow.Load())
			}
			src.PrepareMigration()
			b := save(t, src.FS)
			src.CancelMigration()

			dst := newDest(t, src, opts)
			if err := dst.LoadState(bytes.NewReader(b), restoreCaps(src.caps.Load())); err != nil {
				t.Fatal(err)
			}
			check := func(step string) {
				t.Helper()
				for node, ino := range want {
					if a, errno := dst.getattrErr(node); errno != 0 || a.Ino != ino {
						t.Fatalf("%s: node %#x: ino %d, %v; want %d", step, node, a.Ino, errno, ino)
					}
				}
			}
			check("after load")
			dst.evictUnused()
			if dst.evictedNow.Load() < 50 {
				t.Fatalf("%d evicted on the destination", dst.evictedNow.Load())
			}
			check("after eviction")
			if dst.estales.Load() != 0 || dst.reopens.Load() == 0 {
				t.Fatalf("destination: %d ESTALE, %d reopens", dst.estales.Load(), dst.reopens.Load())
			}
		})
	}
}

// BenchmarkGetAttrBudget is GETATTR round robin over 64 held files, each
// in its own directory: with a budget above them all (resident: today's
// cost) and with a budget of 16, where the clock has evicted nearly every
// file and directory by the time GETATTR comes back to it, so each request
// reopens two components (and evicts).
func BenchmarkGetAttrBudget(b *testing.B) {
	for _, bc := range []struct {
		name   string
		budget int
	}{{"resident", 1000}, {"evicted", fdBudgetMin}} {
		b.Run(bc.name, func(b *testing.B) {
			tf := newTestFS(&testing.T{}, Options{InodeFDBudget: bc.budget})
			defer tf.Close()
			if tf.useHandles {
				b.Skip("inodes held by file handle")
			}
			var nodes []uint64
			for k := range 64 {
				d := fmt.Sprint("d", k)
				must(&testing.T{}, os.Mkdir(tf.path(d), 0o755))
				must(&testing.T{}, os.WriteFile(tf.path(d+"/f"), nil, 0o644))
				var e gofuse.EntryOut
				if errno := tf.Lookup(hdr(rootID), []byte(d), &e); errno != 0 {
					b.Fatal(errno)
				}
				if errno := tf.Lookup(hdr(e.NodeId), []byte("f"), &e); errno != 0 {
					b.Fatal(errno)
				}
				nodes = append(nodes, e.NodeId)
			}
			var out gofuse.AttrOut
			in := &gofuse.GetAttrIn{}
			r0 := tf.reopens.Load()
			b.ReportAllocs()
			k := 0
			for b.Loop() {
				in.NodeId = nodes[k%len(nodes)]
				k++
				if errno := tf.GetAttr(in, &out); errno != 0 {
					b.Fatal(errno)
				}
			}
			b.ReportMetric(float64(tf.reopens.Load()-r0)/float64(k), "reopens/op")
		})
	}
}

// TestBudgetLogsOnce: reaching the budget, and running out of fds, are
// each logged once, saying what to do.
func TestBudgetLogsOnce(t *testing.T) {
	dir := t.TempDir()
	rec := &countingLog{}
	f, err := New(dir, Options{InodeFDBudget: fdBudgetMin}, slog.New(rec))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if f.useHandles {
		t.Skip("inodes held by file handle")
	}
	f.nameInline = true
	f.Init(f.Capabilities())
	for k := range 3 * fdBudgetMin {
		name := fmt.Sprint("f", k)
		must(t, os.WriteFile(filepath.Join(dir, name), nil, 0o644))
		var e gofuse.EntryOut
		if errno := f.Lookup(hdr(rootID), []byte(name), &e); errno != 0 {
			t.Fatal(errno)
		}
	}
	f.warnFDLimit(syscall.EMFILE)
	f.warnFDLimit(syscall.ENFILE)
	f.warnFDLimit(syscall.ENOENT)
	if b, o := rec.count("inode fd budget reached"), rec.count("out of file descriptors"); b != 1 || o != 1 {
		t.Fatalf("budget logged %d times, fd exhaustion %d times: %q", b, o, rec.msgs)
	}
	if !strings.Contains(strings.Join(rec.msgs, "\n"), "--inode-fd-budget") {
		t.Fatalf("no option named: %q", rec.msgs)
	}
}

// TestBudgetOpenFilesEvicted: the inodes of open files are evicted like
// any other (their requests use the handle's fd): open files more than
// the budget leave the inode fds within it, and each file still reads
// through its handle and answers GETATTR (reopened by name).
func TestBudgetOpenFilesEvicted(t *testing.T) {
	tf := budgetFS(t)
	mkTree(t, tf, 1, 40)
	d := tf.lookup(rootID, "d0").NodeId
	var nodes, fhs []uint64
	for n := range 40 {
		e := tf.lookup(d, fmt.Sprint("f", n))
		nodes = append(nodes, e.NodeId)
		fhs = append(fhs, tf.open(e.NodeId, unix.O_RDONLY))
	}
	tf.evictUnused()
	if r := tf.residentFDs.Load(); r > tf.budget {
		t.Fatalf("%d resident inode fds with 40 files open, budget %d", r, tf.budget)
	}
	evicted := 0
	for n, node := range nodes {
		if !tf.resident(node) {
			evicted++
		}
		if got := string(tf.read(node, fhs[n], 0, 8)); got != fmt.Sprint(0, n) {
			t.Fatalf("f%d reads %q", n, got)
		}
		if a := tf.getattr(node); a.Size != uint64(len(fmt.Sprint(0, n))) {
			t.Fatalf("f%d: size %d", n, a.Size)
		}
		tf.release(node, fhs[n])
	}
	if evicted == 0 {
		t.Fatal("no inode of an open file was evicted")
	}
}

// TestBudgetFullOfNameless: inodes that cannot be evicted (nameless: the
// guest unlinked them while it holds them) fill the budget. A sweep says
// so once and is not retried per request, and every request still works.
func TestBudgetFullOfNameless(t *testing.T) {
	tf := budgetFS(t)
	mkTree(t, tf, 1, 60)
	d := tf.lookup(rootID, "d0").NodeId
	for n := 40; n < 60; n++ {
		tf.lookup(d, fmt.Sprint("f", n)) // the budget is reached: tracked
	}
	if !tf.isTracking() {
		t.Fatal("not tracked at the budget")
	}
	var held []uint64
	for n := range 24 {
		e := tf.lookup(d, fmt.Sprint("f", n))
		if errno := tf.Unlink(hdr(d), []byte(fmt.Sprint("f", n))); errno != 0 {
			t.Fatal(errno)
		}
		held = append(held, e.NodeId)
	}
	tf.lookup(d, "f24")
	if tf.sweepAgainAt.Load() == 0 {
		t.Fatal("a futile sweep is retried at once")
	}
	for n := 25; n < 40; n++ {
		e := tf.lookup(d, fmt.Sprint("f", n))
		if a := tf.getattr(e.NodeId); a.Ino != e.Attr.Ino {
			t.Fatalf("f%d: ino %d, want %d", n, a.Ino, e.Attr.Ino)
		}
	}
	for _, node := range held {
		if !tf.resident(node) {
			t.Fatalf("nameless node %#x was evicted", node)
		}
		tf.getattr(node)
	}
}

// TestBudgetUntrackedBelow: below the budget no name is recorded and the
// guest's renames and unlinks are not tracked (no allocation, no statx);
// when the budget is reached, the inodes held are named from their /proc
// links before anything is evicted, so they stay reachable.
func TestBudgetUntrackedBelow(t *testing.T) {
	tf := budgetFS(t)
	must(t, os.Mkdir(tf.path("d"), 0o755))
	must(t, os.WriteFile(tf.path("d/f"), []byte("f"), 0o644))
	must(t, os.WriteFile(tf.path("x"), []byte("x"), 0o644))
	must(t, os.Link(tf.path("x"), tf.path("x2")))
	d := tf.lookup(rootID, "d").NodeId
	f := tf.lookup(d, "f")
	x := tf.lookup(rootID, "x")
	if errno := tf.Rename(hdr(d), rootID, 0, []byte("f"), []byte("e")); errno != 0 {
		t.Fatal(errno)
	}
	if errno := tf.Unlink(hdr(rootID), []byte("x")); errno != 0 {
		t.Fatal(errno)
	}
	if tf.isTracking() || tf.nodes.get(f.NodeId).name.Load() != nil {
		t.Fatal("tracked below the budget")
	}
	mkTree(t, tf, 1, 30)
	d0 := tf.lookup(rootID, "d0").NodeId
	for n := range 30 {
		tf.lookup(d0, fmt.Sprint("f", n))
	}
	if tf.track.Load() != tracked {
		t.Fatal("budget reached, not tracking")
	}
	check := func(step string) {
		t.Helper()
		for _, e := range []gofuse.EntryOut{f, x} {
			if a, errno := tf.getattrErr(e.NodeId); errno != 0 || a.Ino != e.Attr.Ino {
				t.Fatalf("%s: node %#x: ino %d, %v; want %d", step, e.NodeId, a.Ino, errno, e.Attr.Ino)
			}
		}
	}
	// Named from their /proc links: f as e; x's name was unlinked, so
	// it stays resident until a lookup names it again.
	tf.evictUnused()
	if tf.resident(f.NodeId) || !tf.resident(x.NodeId) {
		t.Fatalf("resident: f %v (renamed: want evicted), x %v (unlinked: want resident)", tf.resident(f.NodeId), tf.resident(x.NodeId))
	}
	check("after eviction")
	tf.lookup(rootID, "x2")
	tf.evictUnused()
	if tf.resident(x.NodeId) {
		t.Fatal("x, named again, not evicted")
	}
	check("after a lookup and eviction")
	if tf.estales.Load() != 0 {
		t.Fatalf("%d ESTALE", tf.estales.Load())
	}
}

// TestBudgetNamingInBackground: as the daemon runs, the naming pass at the
// first budget hit runs beside the requests (the budget is exceeded
// meanwhile), then evictions bring the fds back under it.
func TestBudgetNamingInBackground(t *testing.T) {
	tf := newTestFS(t, Options{InodeFDBudget: fdBudgetMin})
	if tf.useHandles {
		t.Skip("inodes held by file handle: no fd budget")
	}
	mkTree(t, tf, 2, 30)
	var all []gofuse.EntryOut
	for d := range 2 {
		dn := tf.lookup(rootID, fmt.Sprint("d", d)).NodeId
		for n := range 30 {
			all = append(all, tf.lookup(dn, fmt.Sprint("f", n)))
		}
		if d == 0 {
			tf.naming.Wait()
		}
	}
	if r := tf.residentFDs.Load(); tf.track.Load() != tracked || r > fdBudgetMin {
		t.Fatalf("%d resident fds once named, budget %d", r, fdBudgetMin)
	}
	for _, e := range all {
		if a := tf.getattr(e.NodeId); a.Ino != e.Attr.Ino {
			t.Fatalf("node %#x: ino %d, want %d", e.NodeId, a.Ino, e.Attr.Ino)
		}
	}
}

// An open that finds every fd taken (EMFILE) sheds inode fds and tries
// again, so the guest does not see EMFILE while unused inodes hold fds:
// a share of more files than the budget, all looked up, then more of
// them opened than RLIMIT_NOFILE leaves beside the budget. It runs in a
// child process, whose RLIMIT_NOFILE it lowers.
func TestOpenShedsInodeFDs(t *testing.T) {
	if os.Getenv("PT_FILE_HANDLES") != "" || os.Getenv("PT_FD_BUDGET") != "" {
		t.Skip("the variants' own settings")
	}
	const limit, files, opens = 256, 300, 140
	if os.Getenv("PT_SHED_CHILD") == "" {
		cmd := exec.Command(os.Args[0], "-test.run=^TestOpenShedsInodeFDs$", "-test.count=1", "-test.v")
		cmd.Env = append(os.Environ(), "PT_SHED_CHILD=1")
		out, err := cmd.CombinedOutput()
		if err != nil || !bytes.Contains(out, []byte("--- PASS: TestOpenShedsInodeFDs")) {
			t.Fatalf("child: %v\n%s", err, out)
		}
		return
	}
	var rl unix.Rlimit
	unix.Getrlimit(unix.RLIMIT_NOFILE, &rl)
	rl.Cur = limit
	if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &rl); err != nil {
		t.Fatal(err)
	}
	log := &countingLog{}
	base := t.TempDir()
	dir := filepath.Join(base, "share")
	os.Mkdir(dir, 0o755)
	for n := range files {
		must(t, os.WriteFile(filepath.Join(dir, fmt.Sprintf("f%d", n)), nil, 0o644))
	}
	must(t, os.WriteFile(filepath.Join(dir, "new"), nil, 0o644))
	f, err := New(dir, Options{InodeFileHandles: FileHandlesNever}, slog.New(log))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	f.Init(f.Capabilities())
	tf := &testFS{FS: f, t: t, dir: dir, base: base}
	if b := tf.budget; b != limit/2 {
		t.Fatalf("budget %d, want %d", b, limit/2)
	}
	var nodes []uint64
	for n := range files {
		nodes = append(nodes, tf.lookup(rootID, fmt.Sprintf("f%d", n)).NodeId)
	}
	tf.naming.Wait()
	// Without shedding: the budget's fds, the process's own and the
	// opens do not fit in the limit.
	if own := countFDs(t); tf.budget*15/16+opens+own <= limit {
		t.Fatalf("the test does not run out of fds: budget %d, %d opens, %d fds of the process's own", tf.budget, opens, own)
	}
	for k, node := range nodes[:opens] {
		var out gofuse.OpenOut
		if errno := tf.Open(&gofuse.OpenIn{InHeader: *hdr(node), Flags: unix.O_RDONLY}, &out); errno != 0 {
			t.Fatalf("open %d of %d: %v (inode fds %d, handle fds %d)", k+1, opens, errno, tf.Stats().InodeFDs, tf.Stats().HandleFDs)
		}
	}
	if n := log.count("out of file descriptors"); n != 0 {
		t.Fatalf("%d warnings of fds run out: %q", n, log.msgs)
	}
	// And a LOOKUP of a name not looked up yet still finds an fd.
	tf.lookup(rootID, "new")
}

// countFDs is the fds the test process holds.
func countFDs(t *testing.T) int64 {
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	return int64(len(ents))
}
