package passthrough

import (
	"cmp"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
	"syscall"
)

// IDMap translates user ids, or group ids, between the guest and the host
// without a user namespace: the Rust virtiofsd's --translate-uid and
// --translate-gid. The two directions are independent tables of
// non-overlapping ranges; an id no range covers maps to itself.
//
//	guest:G:H:N         guest G..G+N-1 are host H..H+N-1
//	host:H:G:N          host H..H+N-1 appear as guest G..G+N-1
//	map:G:H:N           both of the above
//	squash-guest:G:H:N  guest G..G+N-1 all become host H
//	squash-host:H:G:N   host H..H+N-1 all appear as guest G
//	forbid-guest:G:N    guest G..G+N-1 may not be used (EPERM)
//
// Guest to host applies to the credentials a request runs with and to the
// owner SETATTR sets; host to guest to the owners returned in attributes.
// A nil *IDMap is the identity.
type IDMap struct {
	toHost  []idRule // sorted by first
	toGuest []idRule
}

type idRuleKind uint8

const (
	idShift  idRuleKind = iota // first+i → to+i
	idSquash                   // first..last → to
	idForbid                   // first..last → EPERM
)

// idRule maps the source ids first..last (inclusive).
type idRule struct {
	first, last uint32
	to          uint32
	kind        idRuleKind
}

func (r idRule) apply(id uint32) (uint32, bool) {
	switch r.kind {
	case idShift:
		return r.to + (id - r.first), true
	case idSquash:
		return r.to, true
	}
	return 0, false
}

func (r idRule) String() string {
	switch r.kind {
	case idShift:
		return fmt.Sprintf("[%d, %d] to [%d, %d]", r.first, r.last, r.to, r.to+(r.last-r.first))
	case idSquash:
		return fmt.Sprintf("[%d, %d] to %d", r.first, r.last, r.to)
	}
	return fmt.Sprintf("[%d, %d] forbidden", r.first, r.last)
}

// IDMapping is one parsed --translate-uid/--translate-gid argument: a rule
// for one direction or both.
type IDMapping struct {
	spec    string
	toHost  *idRule
	toGuest *idRule
}

func (m IDMapping) String() string { return m.spec }

// ParseIDMapping parses one argument: a type, then its numbers, each
// preceded by the same separator character (":" in practice; the Rust
// daemon accepts any character that cannot be part of the type).
func ParseIDMapping(spec string) (IDMapping, error) {
	i := strings.IndexFunc(spec, func(r rune) bool {
		return !(r == '-' || r == '_' || r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9')
	})
	if i <= 0 {
		return IDMapping{}, fmt.Errorf("id mapping %q: want TYPE:FROM:TO:COUNT or forbid-guest:FROM:COUNT", spec)
	}
	kind := strings.ToLower(spec[:i])
	sep := spec[i : i+1]
	var n []uint32
	for _, f := range strings.Split(spec[i+1:], sep) {
		v, err := strconv.ParseUint(f, 10, 32)
		if err != nil {
			return IDMapping{}, fmt.Errorf("id mapping %q: %q is not an id", spec, f)
		}
		n = append(n, uint32(v))
	}
	want := 3
	if kind == "forbid-guest" {
		want = 2
	}
	if len(n) != want {
		return IDMapping{}, fmt.Errorf("id mapping %q: %s takes %d numbers, got %d", spec, kind, want, len(n))
	}
	count := n[want-1]
	if count == 0 {
		return IDMapping{}, fmt.Errorf("id mapping %q: count is 0", spec)
	}
	// rng builds the rule for from..from+count-1, which like its target
	// range (for a shift) must end below 2^32-1, as in the Rust daemon.
	rng := func(from, to uint32, k idRuleKind) (*idRule, error) {
		if uint64(from)+uint64(count) > math.MaxUint32 || k == idShift && uint64(to)+uint64(count) > math.MaxUint32 {
			return nil, fmt.Errorf("id mapping %q: range exceeds the 32-bit ids", spec)
		}
		return &idRule{first: from, last: from + count - 1, to: to, kind: k}, nil
	}
	m := IDMapping{spec: spec}
	var err error
	switch kind {
	case "guest":
		m.toHost, err = rng(n[0], n[1], idShift)
	case "host":
		m.toGuest, err = rng(n[0], n[1], idShift)
	case "map":
		if m.toHost, err = rng(n[0], n[1], idShift); err == nil {
			m.toGuest, err = rng(n[1], n[0], idShift)
		}
	case "squash-guest":
		m.toHost, err = rng(n[0], n[1], idSquash)
	case "squash-host":
		m.toGuest, err = rng(n[0], n[1], idSquash)
	case "forbid-guest":
		m.toHost, err = rng(n[0], 0, idForbid)
	default:
		return IDMapping{}, fmt.Errorf("id mapping %q: unknown type %q (guest, host, map, squash-guest, squash-host, forbid-guest)", spec, kind)
	}
	return m, err
}

// NewIDMap builds the map from arguments in command-line order. Ranges of
// one direction may not overlap. No arguments: a nil map (the identity).
func NewIDMap(specs []string) (*IDMap, error) {
	if len(specs) == 0 {
		return nil, nil
	}
	m := &IDMap{}
	for _, s := range specs {
		p, err := ParseIDMapping(s)
		if err != nil {
			return nil, err
		}
		if m.toHost, err = addRule(m.toHost, p.toHost, "guest-to-host", s); err != nil {
			return nil, err
		}
		if m.toGuest, err = addRule(m.toGuest, p.toGuest, "host-to-guest", s); err != nil {
			return nil, err
		}
	}
	return m, nil
}

func addRule(rules []idRule, r *idRule, dir, spec string) ([]idRule, error) {
	if r == nil {
		return rules, nil
	}
	for _, o := range rules {
		if r.first <= o.last && o.first <= r.last {
			return nil, fmt.Errorf("id mapping %q: %s range %s overlaps %s", spec, dir, r, o)
		}
	}
	i, _ := slices.BinarySearchFunc(rules, r.first, func(o idRule, id uint32) int {
		return cmp.Compare(o.first, id)
	})
	return slices.Insert(rules, i, *r), nil
}

func lookup(rules []idRule, id uint32) (uint32, bool) {
	// Few rules in practice: a linear scan over a sorted slice.
	for _, r := range rules {
		if id < r.first {
			break
		}
		if id <= r.last {
			return r.apply(id)
		}
	}
	return id, true
}

// ToHost maps a guest id to the host; ok is false for a forbidden id.
func (m *IDMap) ToHost(id uint32) (host uint32, ok bool) {
	if m == nil {
		return id, true
	}
	return lookup(m.toHost, id)
}

// ToGuest maps a host id to the guest.
func (m *IDMap) ToGuest(id uint32) uint32 {
	if m == nil {
		return id
	}
	g, _ := lookup(m.toGuest, id) // no host-to-guest rule forbids
	return g
}

// idMaps holds both maps; the FS has one only when a mapping was given, so
// the request path pays a nil check and nothing more without one.
type idMaps struct {
	uid, gid *IDMap
}

// toHost maps a guest uid and gid; EPERM if either is forbidden.
func (m *idMaps) toHost(uid, gid uint32) (uint32, uint32, syscall.Errno) {
	hu, ok := m.uid.ToHost(uid)
	if !ok {
		return 0, 0, syscall.EPERM
	}
	hg, ok := m.gid.ToHost(gid)
	if !ok {
		return 0, 0, syscall.EPERM
	}
	return hu, hg, 0
}

// toGuest rewrites host owner ids as the guest sees them.
func (m *idMaps) toGuest(uid, gid *uint32) {
	*uid = m.uid.ToGuest(*uid)
	*gid = m.gid.ToGuest(*gid)
}
