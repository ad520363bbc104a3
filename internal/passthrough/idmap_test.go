package passthrough

import (
	"os"
	"strings"
	"syscall"
	"testing"

	gofuse "github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"
)

func TestParseIDMapping(t *testing.T) {
	for _, tc := range []struct {
		spec            string
		toHost, toGuest *idRule
		err             string
	}{
		{spec: "guest:1000:2000:10", toHost: &idRule{1000, 1009, 2000, idShift}},
		{spec: "host:2000:1000:10", toGuest: &idRule{2000, 2009, 1000, idShift}},
		{spec: "map:0:100000:65536", toHost: &idRule{0, 65535, 100000, idShift}, toGuest: &idRule{100000, 165535, 0, idShift}},
		{spec: "squash-guest:0:107:4294967295", toHost: &idRule{0, 4294967294, 107, idSquash}},
		{spec: "squash-host:0:0:65536", toGuest: &idRule{0, 65535, 0, idSquash}},
		{spec: "forbid-guest:500:5", toHost: &idRule{500, 504, 0, idForbid}},
		{spec: "Guest/1/2/3", toHost: &idRule{1, 3, 2, idShift}}, // any separator, type case-insensitive
		{spec: "guest:1:2", err: "takes 3 numbers"},
		{spec: "forbid-guest:1:2:3", err: "takes 2 numbers"},
		{spec: "guest:1:2:0", err: "count is 0"},
		{spec: "guest:1:2:4294967295", err: "exceeds"},
		{spec: "guest:0:1:4294967295", err: "exceeds"}, // the target range
		{spec: "guest:-1:2:3", err: "not an id"},
		{spec: "guest:1:2:3x", err: "not an id"},
		{spec: "guest:1;2;3", err: "not an id"}, // one separator throughout
		{spec: "both:1:2:3", err: "unknown type"},
		{spec: "guest", err: "want TYPE"},
		{spec: ":1:2:3", err: "want TYPE"},
		{spec: "", err: "want TYPE"},
	} {
		m, err := ParseIDMapping(tc.spec)
		if tc.err != "" {
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Errorf("%q: error %v, want one containing %q", tc.spec, err, tc.err)
			}
			continue
		}
		if err != nil {
			t.Errorf("%q: %v", tc.spec, err)
			continue
		}
		if !sameRule(m.toHost, tc.toHost) || !sameRule(m.toGuest, tc.toGuest) {
			t.Errorf("%q: rules %v / %v, want %v / %v", tc.spec, m.toHost, m.toGuest, tc.toHost, tc.toGuest)
		}
	}
}

func sameRule(a, b *idRule) bool {
	if a == nil || b == nil {
		return a == b
	}
	return *a == *b
}

func TestIDMapTranslate(t *testing.T) {
	// A typical unprivileged set-up: the guest's root is the host user
	// 1000, every other guest id is squashed onto it, host ids the guest
	// should not see appear as nobody, and guest 666 is refused.
	m, err := NewIDMap([]string{
		"map:0:1000:1",
		"forbid-guest:666:1",
		"squash-guest:1:1000:665",
		"squash-guest:667:1000:1000",
		"host:0:65534:1000",
	})
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		guest, host uint32
		ok          bool
	}{
		{0, 1000, true}, {1, 1000, true}, {665, 1000, true}, {666, 0, false},
		{667, 1000, true}, {1666, 1000, true}, {1667, 1667, true}, // unmapped: identity
		{4294967295, 4294967295, true},
	} {
		if h, ok := m.ToHost(tc.guest); h != tc.host || ok != tc.ok {
			t.Errorf("ToHost(%d) = %d, %v; want %d, %v", tc.guest, h, ok, tc.host, tc.ok)
		}
	}
	for _, tc := range []struct{ host, guest uint32 }{
		{1000, 0}, {0, 65534}, {999, 66533}, {1001, 1001}, {4294967295, 4294967295},
	} {
		if g := m.ToGuest(tc.host); g != tc.guest {
			t.Errorf("ToGuest(%d) = %d, want %d", tc.host, g, tc.guest)
		}
	}
	var identity *IDMap
	if h, ok := identity.ToHost(42); h != 42 || !ok || identity.ToGuest(43) != 43 {
		t.Error("nil map is not the identity")
	}
}

func TestIDMapOverlap(t *testing.T) {
	for _, tc := range []struct {
		specs []string
		err   bool
	}{
		{[]string{"guest:0:100:10", "guest:10:200:10"}, false},      // adjacent
		{[]string{"guest:0:100:10", "guest:9:200:10"}, true},        // overlapping guest ranges
		{[]string{"guest:0:100:10", "host:0:100:10"}, false},        // other direction
		{[]string{"map:0:100:10", "host:105:0:1"}, true},            // map covers host 100..109
		{[]string{"forbid-guest:5:1", "squash-guest:0:1:10"}, true}, // forbid inside a squash
		{[]string{"squash-host:0:0:65536", "squash-guest:0:0:65536"}, false},
	} {
		_, err := NewIDMap(tc.specs)
		if (err != nil) != tc.err {
			t.Errorf("%q: error %v, want error %v", tc.specs, err, tc.err)
		}
	}
	if m, err := NewIDMap(nil); m != nil || err != nil {
		t.Errorf("no specs: %v, %v; want nil, nil", m, err)
	}
}

// TestTranslateOnRequests: guest ids become host ids for creation and
// SETATTR, host owners are reported as guest ids, and a forbidden guest id
// is refused.
func TestTranslateOnRequests(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to create files for other users")
	}
	uids, err := NewIDMap([]string{"map:1000:2000:10", "forbid-guest:666:1"})
	if err != nil {
		t.Fatal(err)
	}
	gids, err := NewIDMap([]string{"squash-guest:0:3000:65536", "host:3000:7:1"})
	if err != nil {
		t.Fatal(err)
	}
	tf := newTestFS(t, Options{TranslateUID: uids, TranslateGID: gids})
	os.Chmod(tf.dir, 0o777)

	var e gofuse.EntryOut
	if errno := tf.Mkdir(&gofuse.MkdirIn{InHeader: *hdrAs(rootID, 1001, 5), Mode: 0o755}, noGroup, nil, []byte("d"), &e); errno != 0 {
		t.Fatal(errno)
	}
	if st := statHost(t, tf.path("d")); st.Uid != 2001 || st.Gid != 3000 {
		t.Errorf("guest 1001:5 created a directory owned by host %d:%d, want 2001:3000", st.Uid, st.Gid)
	}
	if e.Attr.Uid != 1001 || e.Attr.Gid != 7 {
		t.Errorf("MKDIR reply owner %d:%d, want 1001:7", e.Attr.Uid, e.Attr.Gid)
	}
	var co gofuse.CreateOut
	if errno := tf.Create(&gofuse.CreateIn{InHeader: *hdrAs(e.NodeId, 1001, 5), Flags: unix.O_RDWR, Mode: 0o600}, noGroup, nil, []byte("f"), &co); errno != 0 {
		t.Fatal(errno)
	}
	tf.release(co.NodeId, co.Fh)
	if st := statHost(t, tf.path("d/f")); st.Uid != 2001 || st.Gid != 3000 {
		t.Errorf("CREATE: host owner %d:%d, want 2001:3000", st.Uid, st.Gid)
	}
	if errno := tf.Mkdir(&gofuse.MkdirIn{InHeader: *hdrAs(rootID, 666, 5), Mode: 0o755}, noGroup, nil, []byte("x"), &e); errno != syscall.EPERM {
		t.Errorf("MKDIR as forbidden guest uid 666: %v, want EPERM", errno)
	}

	// A host file owned by an unmapped host id, then by a mapped one.
	if err := os.WriteFile(tf.path("h"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	os.Chown(tf.path("h"), 2005, 3000)
	h := tf.lookup(rootID, "h")
	if h.Attr.Uid != 1005 || h.Attr.Gid != 7 {
		t.Errorf("LOOKUP owner %d:%d, want 1005:7", h.Attr.Uid, h.Attr.Gid)
	}
	if a := tf.getattr(h.NodeId); a.Uid != 1005 || a.Gid != 7 {
		t.Errorf("GETATTR owner %d:%d, want 1005:7", a.Uid, a.Gid)
	}
	var sx gofuse.StatxOut
	if errno := tf.Statx(&gofuse.StatxIn{InHeader: *hdr(h.NodeId), SxMask: unix.STATX_BASIC_STATS}, &sx); errno != 0 {
		t.Fatal(errno)
	} else if sx.Statx.Uid != 1005 || sx.Statx.Gid != 7 {
		t.Errorf("STATX owner %d:%d, want 1005:7", sx.Statx.Uid, sx.Statx.Gid)
	}

	// SETATTR chown takes guest ids.
	var ao gofuse.AttrOut
	in := &gofuse.SetAttrIn{SetAttrInCommon: gofuse.SetAttrInCommon{InHeader: *hdr(h.NodeId), Valid: gofuse.FATTR_UID | gofuse.FATTR_GID, Owner: gofuse.Owner{Uid: 1009, Gid: 42}}}
	if errno := tf.SetAttr(in, &ao); errno != 0 {
		t.Fatal(errno)
	}
	if st := statHost(t, tf.path("h")); st.Uid != 2009 || st.Gid != 3000 {
		t.Errorf("SETATTR to guest 1009:42: host owner %d:%d, want 2009:3000", st.Uid, st.Gid)
	}
	if ao.Uid != 1009 || ao.Gid != 7 {
		t.Errorf("SETATTR reply owner %d:%d, want 1009:7", ao.Uid, ao.Gid)
	}
	in.Owner.Uid = 666
	in.Valid = gofuse.FATTR_UID
	if errno := tf.SetAttr(in, &ao); errno != syscall.EPERM {
		t.Errorf("SETATTR to forbidden guest uid 666: %v, want EPERM", errno)
	}

	// READDIRPLUS entries carry guest ids too.
	found := false
	for _, d := range tf.readdirAll(rootID, true, 4096) {
		if d.name != "h" {
			continue
		}
		found = true
		if d.entry.Attr.Uid != 1009 || d.entry.Attr.Gid != 7 {
			t.Errorf("READDIRPLUS owner %d:%d, want 1009:7", d.entry.Attr.Uid, d.entry.Attr.Gid)
		}
	}
	if !found {
		t.Error("READDIRPLUS did not list h")
	}
}
