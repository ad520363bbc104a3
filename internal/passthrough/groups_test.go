package passthrough

import (
	"os"
	"syscall"
	"testing"

	gofuse "github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"
)

// Several supplementary groups (FUSE_EXT_GROUPS with nr_groups > 1): each
// grants what it would grant the caller on the host, and only for the
// request.
func TestCreateSeveralGroups(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to switch credentials")
	}
	tf := newTestFS(t, Options{})
	for _, d := range []struct {
		name string
		gid  int
	}{{"g1", 4241}, {"g2", 4242}} {
		if err := os.Mkdir(tf.path(d.name), 0o770); err != nil {
			t.Fatal(err)
		}
		os.Chown(tf.path(d.name), 0, d.gid)
		os.Chmod(tf.path(d.name), 0o770)
	}
	g1, g2 := tf.lookup(rootID, "g1").NodeId, tf.lookup(rootID, "g2").NodeId
	var eo gofuse.EntryOut
	mkdir := func(dir uint64, name string, groups []uint32) syscall.Errno {
		return tf.Mkdir(&gofuse.MkdirIn{InHeader: *hdrAs(dir, 1000, 1000), Mode: 0o755}, groups, nil, []byte(name), &eo)
	}
	both := []uint32{4240, 4241, 4242}
	for _, tc := range []struct {
		dir    uint64
		name   string
		groups []uint32
		want   syscall.Errno
	}{
		{g1, "a", both, 0},
		{g2, "a", both, 0},
		{g1, "b", nil, syscall.EACCES},
		{g2, "b", []uint32{4241}, syscall.EACCES},
		{g2, "c", []uint32{4242}, 0},
		{g1, "d", []uint32{4242}, syscall.EACCES}, // the previous groups are gone
	} {
		if errno := mkdir(tc.dir, tc.name, tc.groups); errno != tc.want {
			t.Errorf("mkdir %s in %d with %v: %v, want %v", tc.name, tc.dir, tc.groups, errno, tc.want)
		}
	}
	if st := statHost(t, tf.path("g2/a")); st.Uid != 1000 || st.Gid != 1000 {
		t.Fatalf("owner %d:%d, want 1000:1000", st.Uid, st.Gid)
	}
	many := make([]uint32, maxGroups+1)
	for i := range many {
		many[i] = 4242
	}
	if errno := mkdir(g2, "e", many); errno != syscall.EINVAL {
		t.Fatalf("%d groups: %v, want EINVAL", len(many), errno)
	}
	if errno := mkdir(g2, "e", many[:maxGroups]); errno != 0 {
		t.Fatalf("%d groups: %v", maxGroups, errno)
	}
	if gs, _ := unix.Getgroups(); len(gs) > 1 {
		t.Fatalf("process groups %v", gs)
	}
}

// With FUSE_ALLOW_IDMAP a request that creates nothing carries uid and gid
// FUSE_INVALID_UIDGID: a creation with them is refused (never run as
// 0xffffffff, never translated, even by a map squashing every other id), an ACCESS with them is the guest's
// business.
func TestInvalidUIDGID(t *testing.T) {
	for _, ids := range []*IDMap{nil, mustIDMap(t, "squash-guest:0:107:4294967295")} {
		opts := Options{}
		if ids != nil {
			opts.TranslateUID, opts.TranslateGID = ids, ids
		}
		tf := newTestFS(t, opts)
		var eo gofuse.EntryOut
		var co gofuse.CreateOut
		for _, id := range [][2]uint32{{invalidUIDGID, 0}, {0, invalidUIDGID}, {invalidUIDGID, invalidUIDGID}} {
			if errno := tf.Mkdir(&gofuse.MkdirIn{InHeader: *hdrAs(rootID, id[0], id[1]), Mode: 0o755}, noGroup, nil, []byte("d"), &eo); errno != syscall.EOVERFLOW {
				t.Fatalf("mkdir as %v: %v, want EOVERFLOW", id, errno)
			}
			if errno := tf.Create(&gofuse.CreateIn{InHeader: *hdrAs(rootID, id[0], id[1]), Flags: unix.O_RDWR, Mode: 0o644}, noGroup, nil, []byte("f"), &co); errno != syscall.EOVERFLOW {
				t.Fatalf("create as %v: %v, want EOVERFLOW", id, errno)
			}
			if errno := tf.Symlink(hdrAs(rootID, id[0], id[1]), noGroup, nil, []byte("t"), []byte("s"), &eo); errno != syscall.EOVERFLOW {
				t.Fatalf("symlink as %v: %v, want EOVERFLOW", id, errno)
			}
		}
		if _, err := os.Lstat(tf.path("d")); err == nil {
			t.Fatal("created")
		}
		os.WriteFile(tf.path("private"), nil, 0o600)
		os.Chown(tf.path("private"), 4000, 4000)
		p := tf.lookup(rootID, "private").NodeId
		for _, id := range [][2]uint32{{invalidUIDGID, invalidUIDGID}, {invalidUIDGID, 4000}, {4000, invalidUIDGID}} {
			if errno := tf.Access(&gofuse.AccessIn{InHeader: *hdrAs(p, id[0], id[1]), Mask: unix.R_OK | unix.W_OK}); errno != 0 {
				t.Fatalf("access as %v: %v", id, errno)
			}
		}
	}
	// A read-only share still says so.
	tf := newTestFS(t, Options{ReadOnly: true})
	os.WriteFile(tf.path("f"), nil, 0o644)
	n := tf.lookup(rootID, "f").NodeId
	in := &gofuse.AccessIn{InHeader: *hdrAs(n, invalidUIDGID, invalidUIDGID)}
	for mask, want := range map[uint32]syscall.Errno{unix.R_OK: 0, unix.W_OK: syscall.EROFS} {
		in.Mask = mask
		if errno := tf.Access(in); errno != want {
			t.Errorf("read-only access %#x without ids: %v, want %v", mask, errno, want)
		}
	}
}

func mustIDMap(t *testing.T, specs ...string) *IDMap {
	t.Helper()
	m, err := NewIDMap(specs)
	if err != nil {
		t.Fatal(err)
	}
	return m
}
