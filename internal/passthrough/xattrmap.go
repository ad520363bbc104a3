package passthrough

import (
	"bytes"
	"fmt"
	"strings"
	"syscall"
	"unicode"
)

// xattrMap translates xattr names between guest and host with the C
// daemon's xattrmap rules (docs/tools/virtiofsd.rst of QEMU 5.2–7.2, also
// accepted by the Rust daemon):
//
//	:type:scope:key:prepend:     type prefix|ok|bad|unsupported, scope client|server|all
//	:map:key:prepend:            shorthand, at most once and last
//
// The first character of a rule is its separator. Guest names (GET/SET/
// REMOVEXATTR) are matched against key by the client rules, host names
// (LISTXATTR) against prepend by the server rules; the first match decides.
// prefix prepends (client) or strips (server) prepend; ok passes the name;
// bad refuses it with EPERM (ENODATA for GETXATTR) or hides it;
// unsupported refuses with ENOTSUP or hides it. A name no rule matches is
// treated as bad.
type xattrMap struct {
	rules []xattrRule
}

type xattrRuleType int

const (
	xrPrefix xattrRuleType = iota
	xrOK
	xrBad
	xrUnsupported
)

type xattrRule struct {
	typ            xattrRuleType
	client, server bool
	key, prepend   []byte
}

func parseXattrMap(s string) (*xattrMap, error) {
	if strings.TrimSpace(s) == "" {
		return nil, nil
	}
	m := &xattrMap{}
	rest := s
	sawMap := false
	for {
		rest = strings.TrimLeftFunc(rest, unicode.IsSpace)
		if rest == "" {
			break
		}
		if sawMap {
			return nil, fmt.Errorf("xattrmap: the 'map' rule must be the last one")
		}
		sep := rest[:1]
		rest = rest[1:]
		field := func(what string) (string, error) {
			i := strings.Index(rest, sep)
			if i < 0 {
				return "", fmt.Errorf("xattrmap: missing %s (or its closing %q)", what, sep)
			}
			f := rest[:i]
			rest = rest[i+1:]
			return f, nil
		}
		typ, err := field("type")
		if err != nil {
			return nil, err
		}
		if typ == "map" {
			key, err := field("key")
			if err != nil {
				return nil, err
			}
			prepend, err := field("prepend")
			if err != nil {
				return nil, err
			}
			m.addMap([]byte(key), []byte(prepend))
			sawMap = true
			continue
		}
		r := xattrRule{}
		switch typ {
		case "prefix":
			r.typ = xrPrefix
		case "ok":
			r.typ = xrOK
		case "bad":
			r.typ = xrBad
		case "unsupported":
			r.typ = xrUnsupported
		default:
			return nil, fmt.Errorf("xattrmap: unknown rule type %q", typ)
		}
		scope, err := field("scope")
		if err != nil {
			return nil, err
		}
		switch scope {
		case "client":
			r.client = true
		case "server":
			r.server = true
		case "all":
			r.client, r.server = true, true
		default:
			return nil, fmt.Errorf("xattrmap: unknown scope %q", scope)
		}
		key, err := field("key")
		if err != nil {
			return nil, err
		}
		prepend, err := field("prepend")
		if err != nil {
			return nil, err
		}
		r.key, r.prepend = []byte(key), []byte(prepend)
		m.rules = append(m.rules, r)
	}
	if len(m.rules) == 0 {
		return nil, fmt.Errorf("xattrmap: no rules")
	}
	return m, nil
}

// addMap expands ":map:key:prepend:" as the C daemon does.
func (m *xattrMap) addMap(key, prepend []byte) {
	m.rules = append(m.rules, xattrRule{typ: xrPrefix, client: true, server: true, key: key, prepend: prepend})
	if len(key) == 0 {
		// Hide every host name without the prefix.
		m.rules = append(m.rules, xattrRule{typ: xrBad, client: true, server: true})
		return
	}
	m.rules = append(m.rules,
		// Hide host names that match key without the prefix.
		xattrRule{typ: xrBad, server: true, prepend: key},
		// Keep the guest from reaching prefixed names directly.
		xattrRule{typ: xrBad, client: true, key: prepend},
		// Everything else passes.
		xattrRule{typ: xrOK, client: true, server: true},
	)
}

// toHost maps a guest name to the host name.
func (m *xattrMap) toHost(name []byte) ([]byte, syscall.Errno) {
	for i := range m.rules {
		r := &m.rules[i]
		if !r.client || !bytes.HasPrefix(name, r.key) {
			continue
		}
		switch r.typ {
		case xrBad:
			return nil, syscall.EPERM
		case xrUnsupported:
			return nil, syscall.ENOTSUP
		case xrOK:
			return name, 0
		default:
			out := make([]byte, 0, len(r.prepend)+len(name))
			return append(append(out, r.prepend...), name...), 0
		}
	}
	return nil, syscall.EPERM
}

// toGuest maps a host name for the guest; false hides it.
func (m *xattrMap) toGuest(name []byte) ([]byte, bool) {
	for i := range m.rules {
		r := &m.rules[i]
		if !r.server || !bytes.HasPrefix(name, r.prepend) {
			continue
		}
		switch r.typ {
		case xrOK:
			return name, true
		case xrPrefix:
			if len(name) == len(r.prepend) {
				return nil, false
			}
			return name[len(r.prepend):], true
		default:
			return nil, false
		}
	}
	return nil, false
}
