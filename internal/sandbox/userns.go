package sandbox

import (
	"fmt"
	"os/exec"
	"strconv"
	"strings"
)

// IDMap is one --uid-map/--gid-map range: Count ids from Inside (in the
// user namespace) map to Outside (on the host).
type IDMap struct {
	Inside, Outside, Count uint32
}

// ParseIDMap parses the Rust daemon's ":namespace_id:host_id:count:".
func ParseIDMap(s string) (IDMap, error) {
	f := strings.Split(s, ":")
	if len(f) != 5 || f[0] != "" || f[4] != "" {
		return IDMap{}, fmt.Errorf("id map %q: want :namespace_id:host_id:count:", s)
	}
	var v [3]uint32
	for i, p := range f[1:4] {
		n, err := strconv.ParseUint(p, 10, 32)
		if err != nil {
			return IDMap{}, fmt.Errorf("id map %q: %q is not a number", s, p)
		}
		v[i] = uint32(n)
	}
	if v[2] == 0 {
		return IDMap{}, fmt.Errorf("id map %q: count is 0", s)
	}
	return IDMap{Inside: v[0], Outside: v[1], Count: v[2]}, nil
}

func (m IDMap) String() string { return fmt.Sprintf(":%d:%d:%d:", m.Inside, m.Outside, m.Count) }

// writeIDMaps writes the maps of the user namespace of pid with the setuid
// helpers newuidmap and newgidmap (Debian package uidmap), which check the
// ranges against /etc/subuid and /etc/subgid: an unprivileged process can
// write only one line mapping its own id itself.
func writeIDMaps(pid int, uids, gids []IDMap) error {
	for _, m := range []struct {
		tool string
		maps []IDMap
	}{{"newuidmap", uids}, {"newgidmap", gids}} {
		args := []string{strconv.Itoa(pid)}
		for _, r := range m.maps {
			args = append(args, strconv.FormatUint(uint64(r.Inside), 10),
				strconv.FormatUint(uint64(r.Outside), 10), strconv.FormatUint(uint64(r.Count), 10))
		}
		out, err := exec.Command(m.tool, args...).CombinedOutput()
		if err != nil {
			return fmt.Errorf("%s %s: %v: %s", m.tool, strings.Join(args, " "), err, strings.TrimSpace(string(out)))
		}
	}
	return nil
}
